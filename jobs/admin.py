"""Admin for the job queue, the command boundary and worker sessions (read-only: these rows
change only through ``jobs.services``, ``jobs.commands`` and ``jobs.sessions``)."""

from django.contrib import admin
from django.utils.html import format_html

from core.admin import ReadOnlyAdmin
from jobs.models import AdapterCall, CommandRecord, Deployment, Job, Order, WorkerHeartbeat, WorkerSession


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    list_display = ("id", "type", "project", "live_state", "reason", "priority_class", "priority", "lane",
                    "attempts", "max_attempts", "worker", "created_at", "completed_at")
    list_filter = ("state", "type", "priority_class", "reason", "project", ("created_at", admin.DateFieldListFilter))
    list_select_related = ("project", "project__organization")
    search_fields = ("=id", "lane", "dedupe_key")
    show_full_result_count = False

    @admin.display(description="state", ordering="state")
    def live_state(self, job):
        return format_html('<span class="status-badge" data-live="job-state" data-job="{}" data-value="{}">{}</span>',
                           job.pk, job.state, job.state)


@admin.register(CommandRecord)
class CommandRecordAdmin(ReadOnlyAdmin):
    list_display = ("id", "kind", "project", "idempotency_key", "status", "attempts", "error_code", "created_at",
                    "completed_at")
    list_filter = ("status", "kind", "project", ("created_at", admin.DateFieldListFilter))
    list_select_related = ("project", "project__organization")
    search_fields = ("=id", "idempotency_key", "payload_hash", "error_code")
    show_full_result_count = False


@admin.register(Deployment)
class DeploymentAdmin(ReadOnlyAdmin):
    list_display = ("id", "name", "project", "status", "idempotency_key", "created_at", "stopped_at")
    list_filter = ("status", "project")
    list_select_related = ("project", "project__organization")
    search_fields = ("=id", "name", "idempotency_key")


@admin.register(Order)
class OrderAdmin(ReadOnlyAdmin):
    list_display = ("id", "symbol", "side", "quantity", "price", "status", "project", "deployment",
                    "idempotency_key", "created_at", "cancelled_at")
    list_filter = ("status", "side", "project")
    list_select_related = ("project", "project__organization", "deployment")
    search_fields = ("=id", "symbol", "idempotency_key")


@admin.register(AdapterCall)
class AdapterCallAdmin(ReadOnlyAdmin):
    list_display = ("id", "adapter", "operation", "project", "idempotency_key", "outcome", "created_at")
    list_filter = ("adapter", "operation", "outcome")
    list_select_related = ("project", "project__organization")
    search_fields = ("idempotency_key",)
    show_full_result_count = False


@admin.register(WorkerSession)
class WorkerSessionAdmin(ReadOnlyAdmin):
    list_display = ("key", "status", "system_owned", "generation", "reprovision_count", "preflight_at",
                    "last_used_at", "created_at")
    list_filter = ("status", "system_owned", "agent")
    search_fields = ("key", "owner", "agent")


@admin.register(WorkerHeartbeat)
class WorkerHeartbeatAdmin(ReadOnlyAdmin):
    list_display = ("worker", "cluster", "started_at", "last_seen", "current_job_id", "jobs_done")
    search_fields = ("worker", "cluster")
