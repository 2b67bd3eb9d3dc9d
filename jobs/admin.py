"""Admin for the job queue, the command boundary and worker sessions (read-only: these rows
change only through ``jobs.services``, ``jobs.commands`` and ``jobs.sessions``). Stuck jobs
are requeued, failed or cancelled by runbook actions (``jobs.runbooks``)."""

from datetime import timedelta

from django.conf import settings
from django.contrib import admin
from django.db.models import Q
from django.utils import timezone
from django.utils.html import format_html

from core.admin import ReadOnlyAdmin
from core.admin_runbooks import RunbookAdminMixin, operator_permission, recent_filter
from jobs import runbooks
from jobs.models import (
    WAITING_JOB_STATES,
    AdapterCall,
    CommandRecord,
    Deployment,
    Job,
    JobLane,
    JobState,
    MaintenanceMark,
    Order,
    WorkerHeartbeat,
    WorkerSession,
)


class JobStuckFilter(admin.SimpleListFilter):
    """Executing with an expired lease (its worker is gone), or waiting and claimable for longer
    than one default job timeout (starved: lanes or slots held)."""

    title = "stuck"
    parameter_name = "stuck"

    def lookups(self, request, model_admin):
        return [("lease_expired", "Lease expired (worker lost)"), ("starved", "Claimable but waiting too long")]

    def queryset(self, request, queryset):
        now = timezone.now()
        if self.value() == "lease_expired":
            return queryset.filter(state=JobState.EXECUTING, lease_expires_at__lt=now)
        if self.value() == "starved":
            waited = now - timedelta(milliseconds=settings.ORCHESTRATOR_QUEUE_DEFAULT_TIMEOUT_MS)
            return queryset.filter(state__in=list(WAITING_JOB_STATES), queued_at__lt=waited).filter(
                Q(not_before__isnull=True) | Q(not_before__lt=waited))
        return queryset


@admin.register(Job)
class JobAdmin(RunbookAdminMixin, ReadOnlyAdmin):
    list_display = ("id", "type", "project", "live_state", "reason", "priority_class", "priority", "lane",
                    "attempts", "max_attempts", "worker", "age", "run_id", "created_at", "completed_at")
    list_filter = ("state", JobStuckFilter, "type", "priority_class", "reason", "organization", "project",
                   recent_filter("created_at", "created"), ("created_at", admin.DateFieldListFilter))
    list_select_related = ("project", "project__organization")
    search_fields = ("=id", "lane", "dedupe_key", "=run_id", "worker")
    show_full_result_count = False
    actions = ["requeue", "fail", "cancel"]
    runbooks = {"requeue": runbooks.JOB_REQUEUE, "fail": runbooks.JOB_FAIL, "cancel": runbooks.JOB_CANCEL}

    has_requeue_permission = operator_permission("jobs.requeue_job")
    has_fail_permission = operator_permission("jobs.fail_job")
    has_cancel_permission = operator_permission("jobs.cancel_job")

    @admin.display(description="state", ordering="state")
    def live_state(self, job):
        return format_html('<span class="status-badge" data-live="job-state" data-job="{}" data-value="{}">{}</span>',
                           job.pk, job.state, job.state)

    @admin.display(description="age")
    def age(self, job):
        """How long the job has been in its current phase (executing, or waiting since queued)."""
        if job.is_terminal:
            return "—"
        since = job.started_at if job.state == JobState.EXECUTING else (job.queued_at or job.created_at)
        return f"{int((timezone.now() - since).total_seconds())} s" if since else "—"

    @admin.action(description="Requeue selected stuck jobs…", permissions=["requeue"])
    def requeue(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.JOB_REQUEUE)

    @admin.action(description="Fail selected jobs…", permissions=["fail"])
    def fail(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.JOB_FAIL)

    @admin.action(description="Cancel selected jobs…", permissions=["cancel"])
    def cancel(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.JOB_CANCEL)


@admin.register(JobLane)
class JobLaneAdmin(ReadOnlyAdmin):
    list_display = ("key", "interactive_streak", "updated_at")
    search_fields = ("key",)


@admin.register(MaintenanceMark)
class MaintenanceMarkAdmin(ReadOnlyAdmin):
    list_display = ("name", "last_run")


@admin.register(CommandRecord)
class CommandRecordAdmin(ReadOnlyAdmin):
    list_display = ("id", "kind", "project", "idempotency_key", "status", "attempts", "error_code", "created_at",
                    "completed_at")
    list_filter = ("status", "kind", "project", "error_code", recent_filter("created_at", "created"),
                   ("created_at", admin.DateFieldListFilter))
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
    list_filter = ("status", "system_owned", "agent", recent_filter("last_used_at", "last used"))
    search_fields = ("key", "owner", "agent")


@admin.register(WorkerHeartbeat)
class WorkerHeartbeatAdmin(ReadOnlyAdmin):
    list_display = ("worker", "cluster", "started_at", "last_seen", "seen_ago", "current_job_id", "jobs_done")
    list_filter = (recent_filter("last_seen", "last seen"),)
    search_fields = ("worker", "cluster")

    @admin.display(description="seen", ordering="last_seen")
    def seen_ago(self, heartbeat):
        return f"{int((timezone.now() - heartbeat.last_seen).total_seconds())} s ago"
