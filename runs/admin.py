"""Admin for runs and their hierarchy (read-only; runbook actions come with the console)."""

from django.contrib import admin
from django.utils.html import format_html

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


def live_badge(kind: str, object_id, value: str, *, scope: bool = False):
    """A status that the live admin script keeps current (see core/static/orchestrator/live.js)."""
    key = "run" if kind == "run-status" else "job"
    return format_html('<span class="status-badge" data-live="{}" data-{}="{}" data-value="{}"{}>{}</span>',
                       kind, key, object_id, value,
                       format_html(' data-live-scope-run="{}"', object_id) if scope else "", value)


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    list_display = ("id", "name", "project", "live_status", "status_reason", "priority", "attempt_number",
                    "credits_reserved", "credits_charged", "credits_refunded", "last_error_code", "created_at")
    list_filter = ("status", "failure_mode", "organization", "project", ("created_at", admin.DateFieldListFilter))
    list_select_related = ("project", "project__organization")
    search_fields = ("name", "=id", "last_error_code")
    show_full_result_count = False
    inlines = [RunAttemptInline, AgentInline]
    readonly_fields = ("live_status_scoped", "heartbeat")

    @admin.display(description="status", ordering="status")
    def live_status(self, run):
        return live_badge("run-status", run.pk, run.status)

    @admin.display(description="live status")
    def live_status_scoped(self, run):
        return live_badge("run-status", run.pk, run.status, scope=True)

    @admin.display(description="last heartbeat")
    def heartbeat(self, run):
        ts = run.last_heartbeat.isoformat() if run.last_heartbeat else ""
        return format_html('<span data-live="heartbeat" data-run="{}" data-ts="{}">{}</span>', run.pk, ts,
                           run.last_heartbeat or "never")


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
