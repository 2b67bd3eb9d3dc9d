"""Admin for the job queue, the command boundary and worker sessions (read-only: these rows
change only through ``jobs.services``, ``jobs.commands`` and ``jobs.sessions``). Stuck jobs
are requeued, failed or cancelled by the runbook actions ``jobs.runbooks`` registers."""

from datetime import timedelta
from functools import lru_cache

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path
from django.db.models import OuterRef, Q, Subquery
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from core.admin import ProjectAdmin, ReadOnlyAdmin
from core.admin_runbooks import RunbookAdminMixin, recent_filter, top_values_filter
from core.admin_rows import cell_truncated, cell_with_reason, duration_since, html_text
from core.admin_scale import ScaledListMixin
from core.errors import DomainError
from core.runbooks import RunbookForm, describe_error
from jobs.models import (
    NOT_STARTED_JOB_STATES,
    WAITING_JOB_STATES,
    AdapterCall,
    CommandRecord,
    Deployment,
    Job,
    JobLane,
    JobState,
    MaintenanceMark,
    Order,
    QueuePause,
    WorkerHeartbeat,
    WorkerSession,
)
from core.models import Project
from jobs.registry import definition_types
from jobs.runbooks import QUEUE_PAUSE
from jobs.selectors import jobs_wait_explain, run_jobs_not_started
from jobs.services import queue_pause, queue_resume

RUN_WAITING_JOBS_LIMIT = 5


@lru_cache(maxsize=1)
def run_change_url_prefix() -> str:
    """The run change page's URL up to the run's id (reversed once, not once per row)."""
    return reverse("admin:runs_run_change", args=[0])[:-len("0/change/")]


class ProjectListFilter(admin.RelatedFieldListFilter):
    """The "project" list filter with each project's organization read in the same query (a
    project's name is ``organization/project``: the stock filter reads one organization per project)."""

    def field_choices(self, field, request, model_admin):
        ordering = self.field_admin_ordering(field, request, model_admin) or field.related_model._meta.ordering
        return [(project.pk, str(project)) for project in projects_with_organizations(request, ordering)]


def projects_with_organizations(request, ordering) -> list:
    """Every project with its organization, read once per request (the project filter and the run
    search both use it)."""
    cache = request.__dict__.setdefault("_projects_with_organizations", {})
    key = tuple(ordering)
    if key not in cache:
        cache[key] = list(Project.objects.select_related("organization").order_by(*ordering))
    return cache[key]


def _seconds(value) -> str:
    return "—" if value is None else f"{value:.0f} s"


def wait_explanation_html(explanation: dict):
    """One job's answer to "why is this waiting?" (``jobs.selectors.job_wait_explain``) as HTML.

    The block carries ``data-job``, ``data-wait-blockers`` (the blocker codes, space-separated)
    and ``data-wait-position`` so that scripts and tests can read it.
    """
    holder = explanation["lane_holder"]
    if not explanation["lane"]:
        lane = "none (no lane limit)"
    elif holder:
        lane = format_html('{} — held by <a href="{}">job {}</a> ({}, executing for {} on {})', explanation["lane"],
                           reverse("admin:jobs_job_change", args=[holder["id"]]), holder["id"], holder["type"],
                           _seconds(holder["age_s"]), holder["worker"] or "a worker")
    else:
        lane = format_html("{} — free", explanation["lane"])
    caps = explanation["caps"]
    facts = [
        ("lane", lane),
        ("position", "—" if explanation["jobs_ahead"] is None else format_html(
            "{} ({} claimable job{} ahead, {} claimable in all)",
            explanation["position"] or "not claimable now", explanation["jobs_ahead"],
            "" if explanation["jobs_ahead"] == 1 else "s", explanation["eligible_jobs"])),
        ("priority", f"{explanation['priority']} ({explanation['priority_class']}; lower runs first, "
                     "interactive before background)"),
        ("waiting for", _seconds(explanation["age_s"])),
        ("attempts", f"{explanation['attempts']} of {explanation['max_attempts']}"),
        ("caps", format_html("{}; {} of {} global slots busy",
                             "one executing job per lane" if caps["lane_concurrency"] else "no lane limit",
                             caps["executing"], caps["global_concurrency"])),
        ("eligible at", explanation["eligible_at"] or "now (no delay)"),
    ]
    aging = explanation["aging"]
    if aging:
        facts.append(("aging guard", format_html(
            "lane ran {} interactive job{} in a row (burst {}); {}", aging["lane_interactive_streak"],
            "" if aging["lane_interactive_streak"] == 1 else "s", aging["max_interactive_burst"],
            "aged: claimed before the lane's interactive jobs" if aging["jumps_queue"]
            else ("aged once the burst is reached" if aging["aged"]
                  else f"ages in {_seconds(aging['ages_in_s'])}"))))
    facts.append(("workers alive", str(explanation["workers_alive"])))
    if explanation["deadline_at"]:
        facts.append(("deadline", f"{explanation['deadline_at']} (then completes with its fallback result)"))
    blockers = format_html_join("", '<li data-blocker="{}"><strong>{}</strong>: {}</li>',
                                ((b["code"], b["code"], b["detail"]) for b in explanation["blockers"]))
    rows = format_html_join("", "<tr><th>{}</th><td>{}</td></tr>", facts)
    return format_html(
        '<div class="wait-explain" data-job="{}" data-wait-blockers="{}" data-wait-position="{}">'
        '<p class="wait-summary">{}</p>{}<table class="wait-facts">{}</table></div>',
        explanation["job"], " ".join(b["code"] for b in explanation["blockers"]),
        explanation["position"] or "", explanation["summary"],
        format_html('<ul class="wait-blockers">{}</ul>', blockers) if explanation["blockers"] else "", rows)


def run_waiting_jobs_html(run_id: int):
    """"Why is this waiting?" for a run's jobs that have not started (at most five, oldest first)."""
    jobs = run_jobs_not_started(run_id=run_id, limit=RUN_WAITING_JOBS_LIMIT + 1)
    if not jobs:
        return "no job of this run is waiting"
    more = len(jobs) > RUN_WAITING_JOBS_LIMIT
    jobs = jobs[:RUN_WAITING_JOBS_LIMIT]
    explanations = jobs_wait_explain(jobs)
    items = format_html_join("", '<div class="wait-job"><h4><a href="{}">job {}</a> {} ({})</h4>{}</div>', (
        (reverse("admin:jobs_job_change", args=[job.pk]), job.pk, job.type, job.state,
         wait_explanation_html(explanations[job.pk])) for job in jobs))
    if more:
        url = reverse("admin:jobs_job_changelist") + f"?run_id={run_id}&state__in={','.join(NOT_STARTED_JOB_STATES)}"
        items = format_html('{}<p><a href="{}">all waiting jobs of this run</a></p>', items, url)
    return items


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
class JobAdmin(ScaledListMixin, RunbookAdminMixin, ReadOnlyAdmin):
    # An incident's list (issue 19): state with its reason, type, lane, attempts, how long it
    # waited (or waits) for a worker, its run; one line per row at 1,280 px (core.admin_rows).
    list_display = ("id", "job_type", "state_and_reason", "lane_name", "attempts_of", "wait", "age", "run",
                    "worker_name")
    # Type and reason offer the values of the latest jobs (not a DISTINCT over the whole table);
    # their parameters are the stock filter's (type__exact=, reason__exact=), as the dashboard links.
    list_filter = ("state", JobStuckFilter, top_values_filter("type", "type", parameter="type__exact"),
                   "priority_class", top_values_filter("reason", "reason", parameter="reason__exact"), "organization",
                   ("project", ProjectListFilter),
                   recent_filter("created_at", "created"), recent_filter("completed_at", "finished"),
                   ("created_at", admin.DateFieldListFilter))
    list_select_related = ("project", "project__organization")
    search_fields = ("=id", "lane", "dedupe_key", "=run_id", "worker")
    show_full_result_count = False
    list_defer = ("payload", "result")

    readonly_fields = ("wait_explanation",)

    def get_fieldsets(self, request, obj=None):
        """A waiting job's page opens with why it waits; the job's fields follow."""
        fields = [name for name in self.get_fields(request, obj) if name != "wait_explanation"]
        if obj is not None and obj.state in NOT_STARTED_JOB_STATES:
            return [("Why is this waiting?", {"fields": ["wait_explanation"]}), (None, {"fields": fields})]
        return [(None, {"fields": fields})]

    @admin.display(description="explanation")
    def wait_explanation(self, job):
        return wait_explanation_html(jobs_wait_explain([job])[job.pk])

    @admin.display(description="state", ordering="state")
    def live_state(self, job):
        state = html_text(job.state)
        return mark_safe(f'<span class="status-badge" data-live="job-state" data-job="{job.pk:d}" '
                         f'data-value="{state}">{state}</span>')

    # --- list columns ---------------------------------------------------------------------
    @admin.display(description="type", ordering="type")
    def job_type(self, job):
        return cell_truncated(job.type, css="cell-truncate cell-narrow")

    @admin.display(description="state · reason", ordering="state")
    def state_and_reason(self, job):
        return cell_with_reason(self.live_state(job), job.reason, title=html_text(job.error[:300]) if job.error else "")

    @admin.display(description="lane", ordering="lane")
    def lane_name(self, job):
        return cell_truncated(job.lane, css="cell-truncate cell-narrow")

    @admin.display(description="attempts")
    def attempts_of(self, job):
        return f"{job.attempts}/{job.max_attempts}"

    @admin.display(description="wait")
    def wait(self, job):
        """How long the job waited for a worker: from queued to started, or until now while it waits."""
        queued = job.queued_at or job.created_at
        if job.started_at is not None:
            return duration_since(queued, job.started_at)
        return "—" if job.is_terminal else duration_since(queued, timezone.now())

    @admin.display(description="run", ordering="run_id")
    def run(self, job):
        if job.run_id is None:
            return ""
        return mark_safe(f'<a href="{run_change_url_prefix()}{job.run_id:d}/change/">{job.run_id:d}</a>')

    @admin.display(description="worker", ordering="worker")
    def worker_name(self, job):
        return cell_truncated(job.worker, css="cell-truncate cell-narrow")

    @admin.display(description="in state")
    def age(self, job):
        """How long the job has been in its current phase (executing, or waiting since queued)."""
        if job.is_terminal:
            return "—"
        since = job.started_at if job.state == JobState.EXECUTING else (job.queued_at or job.created_at)
        return duration_since(since, timezone.now())


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
    list_filter = ("status", "kind", ("project", ProjectListFilter), "error_code",
                   recent_filter("created_at", "created"),
                   ("created_at", admin.DateFieldListFilter))
    list_select_related = ("project", "project__organization")
    search_fields = ("=id", "idempotency_key", "payload_hash", "error_code")
    show_full_result_count = False


@admin.register(Deployment)
class DeploymentAdmin(ReadOnlyAdmin):
    list_display = ("id", "name", "project", "status", "idempotency_key", "created_at", "stopped_at")
    list_filter = ("status", ("project", ProjectListFilter))
    list_select_related = ("project", "project__organization")
    search_fields = ("=id", "name", "idempotency_key")


@admin.register(Order)
class OrderAdmin(ReadOnlyAdmin):
    list_display = ("id", "symbol", "side", "quantity", "price", "status", "project", "deployment",
                    "idempotency_key", "created_at", "cancelled_at")
    list_filter = ("status", "side", ("project", ProjectListFilter))
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


# --- paused queues ------------------------------------------------------------------------------

class ProjectQueueAdmin(RunbookAdminMixin, ProjectAdmin):
    """Projects with their queue's runbooks: pause and resume (``jobs.runbooks``)."""

    list_display = (*ProjectAdmin.list_display, "queue")

    def get_queryset(self, request):
        pauses = QueuePause.objects.filter(project_id=OuterRef("pk"))
        return super().get_queryset(request).annotate(paused_by=Subquery(pauses.values("actor_label")[:1]),
                                                      paused_why=Subquery(pauses.values("reason")[:1]))

    @admin.display(description="queue")
    def queue(self, obj):
        return f"paused by {obj.paused_by}: {obj.paused_why}" if obj.paused_by else "claimed"


if admin.site.is_registered(Project):
    admin.site.unregister(Project)
admin.site.register(Project, ProjectQueueAdmin)


class JobTypeQueueForm(RunbookForm):
    job_type = forms.ChoiceField(choices=())
    change = forms.ChoiceField(choices=[("pause", "Pause"), ("resume", "Resume")])

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["job_type"].choices = [(name, name) for name in definition_types()]


@admin.register(QueuePause)
class QueuePauseAdmin(ReadOnlyAdmin):
    """Paused queues; "Pause or resume a job type" is a small page of its own (projects have actions)."""

    list_display = ("id", "queue", "actor_label", "reason", "since")
    list_select_related = ("project",)
    change_list_template = "admin/jobs/queuepause/change_list.html"

    def get_urls(self):
        return [path("job-type/", self.admin_site.admin_view(self.job_type_view), name="jobs_queuepause_job_type"),
                *super().get_urls()]

    def job_type_view(self, request):
        if not request.user.has_perm(QUEUE_PAUSE.permission):
            raise PermissionDenied
        form = JobTypeQueueForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            service = queue_pause if form.cleaned_data["change"] == "pause" else queue_resume
            try:
                service(job_type=form.cleaned_data["job_type"], actor=request.user, reason=form.cleaned_data["reason"])
            except DomainError as exc:
                self.message_user(request, describe_error(exc), messages.ERROR)
            else:
                self.message_user(request, f"Job type {form.cleaned_data['job_type']}: queue "
                                           f"{form.cleaned_data['change']}d.", messages.SUCCESS)
                return HttpResponseRedirect(reverse("admin:jobs_queuepause_changelist"))
        context = {**self.admin_site.each_context(request), "title": "Pause or resume a job type's queue",
                   "opts": self.model._meta, "form": form}
        return TemplateResponse(request, "admin/jobs/queuepause/job_type.html", context)
