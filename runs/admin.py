"""Admin for runs and their hierarchy (read-only; runbook actions come with the console)."""

from django.contrib import admin

from core.admin import ReadOnlyAdmin, ReadOnlyInline
from runs.models import Agent, Artifact, Run, RunAttempt, Step, StepAttempt, Task


class RunAttemptInline(ReadOnlyInline):
    model = RunAttempt
    fields = ("number", "credits_reserved", "credits_charged", "credits_refunded", "outcome", "error_code",
              "created_at", "ended_at")
    readonly_fields = fields


class AgentInline(ReadOnlyInline):
    model = Agent
    fields = ("attempt_number", "name", "status", "failure_mode", "parallelism_mode", "retry_count",
              "last_error_code", "started_at", "finished_at")
    readonly_fields = fields


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    list_display = ("id", "name", "project", "status", "status_reason", "priority", "attempt_number",
                    "credits_reserved", "credits_charged", "credits_refunded", "last_error_code", "created_at")
    list_filter = ("status", "failure_mode", "organization", "project", ("created_at", admin.DateFieldListFilter))
    list_select_related = ("project", "project__organization")
    search_fields = ("name", "=id", "last_error_code")
    show_full_result_count = False
    inlines = [RunAttemptInline, AgentInline]


@admin.register(Agent)
class AgentAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "attempt_number", "name", "status", "failure_mode", "parallelism_mode")
    list_filter = ("status",)
    search_fields = ("=run__id", "name")


@admin.register(Task)
class TaskAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "agent_id", "name", "status", "failure_mode", "parallelism_mode", "retry_count")
    list_filter = ("status",)
    search_fields = ("=run__id", "name")


@admin.register(Step)
class StepAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "task_id", "name", "kind", "tool", "status", "attempts", "credits_charged",
                    "last_error_code")
    list_filter = ("status", "kind", "tool")
    search_fields = ("=run__id", "name", "tool")


@admin.register(StepAttempt)
class StepAttemptAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "step_id", "number", "outcome", "cost", "error_code", "started_at",
                    "finished_at")
    list_filter = ("outcome",)
    search_fields = ("=run__id", "idempotency_key", "error_code")


@admin.register(Artifact)
class ArtifactAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "name", "storage_key", "size_bytes", "expires_at", "deleted_at")
    search_fields = ("=run__id", "name", "storage_key")
