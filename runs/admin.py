"""Admin for runs, their hierarchy, escalations and approvals: the operators' console.

Rows are read-only (they change only through the services); the runbook actions and buttons
(seed 001 §9) come from the runbooks ``runs.runbooks`` registers: each confirms, asks for a
reason, checks its own permission and calls its service. The run
page shows the whole story in a fixed number of queries: attempts, the agent → task → step
tree, ledger entries, escalations, approvals, the latest events and the audit trail.
"""

from __future__ import annotations

from collections import defaultdict

from django.contrib import admin
from django.db.models import Q
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.text import smart_split, unescape_string_literal

from billing.models import LedgerEntry
from core.admin import ReadOnlyAdmin, ReadOnlyInline
from core.admin_rows import cell_since, cell_truncated, cell_with_reason, duration_label, html_text
from core.admin_scale import ScaledListMixin
from core.admin_runbooks import (
    RunbookAdminMixin,
    recent_filter,
    top_values_filter,
)
from core.models import AuditRecord, Event, Project
from jobs.admin import ProjectListFilter, projects_with_organizations, run_waiting_jobs_html
from runs.admin_run_page import RunPageAdminMixin, run_hierarchy_cached
from runs.models import (
    SETTLED_RUN_STATES,
    Agent,
    ApprovalRequest,
    Artifact,
    EscalationTicket,
    Run,
    RunAttempt,
    Step,
    StepAttempt,
    Task,
)
from runs.pipeline.admin import RunPipelineAdminMixin
from runs.selectors import RUN_STUCK_PART_ORDERINGS, run_escalated, run_stuck_parts, run_stuck_q

TIMELINE_LIMIT = 50


# --- inlines on the run page ----------------------------------------------------------------

class RunAttemptInline(ReadOnlyInline):
    model = RunAttempt
    fields = ("number", "credits_reserved", "credits_charged", "credits_refunded", "outcome", "error_code",
              "created_at", "ended_at")
    readonly_fields = fields


class EscalationInline(ReadOnlyInline):
    model = EscalationTicket
    classes = ["collapse"]
    # The ticket's own page has the times of acknowledgement and resolution: the run page keeps to its width.
    fields = ("trigger", "status", "severity", "detail", "created_at", "acknowledged_by", "resolved_by",
              "resolution")
    readonly_fields = fields

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("acknowledged_by", "resolved_by")


class ApprovalRequestInline(ReadOnlyInline):
    model = ApprovalRequest
    classes = ["collapse"]
    fields = ("attempt_number", "gate", "status", "requested_at", "approval_ref", "approved_by", "approved_at")
    readonly_fields = fields

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("approved_by")


def live_badge(kind: str, object_id, value: str, *, scope: bool = False):
    """A status that the live admin script keeps current (see core/static/orchestrator/live.js)."""
    key = "run" if kind == "run-status" else "job"
    object_id, value = html_text(object_id), html_text(value)
    scoped = f' data-live-scope-run="{object_id}"' if scope else ""
    return mark_safe(f'<span class="status-badge" data-live="{kind}" data-{key}="{object_id}" data-value="{value}"'
                     f'{scoped}>{value}</span>')


# --- list filters -----------------------------------------------------------------------------

class StuckFilter(admin.SimpleListFilter):
    """Running with a silent worker, or pending, running, paused, resuming or retrying past its timeout."""

    title = "stuck"
    parameter_name = "stuck"

    def lookups(self, request, model_admin):
        return [("yes", "Stuck"), ("no", "Not stuck")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(run_stuck_q())
        if self.value() == "no":
            return queryset.exclude(run_stuck_q())
        return queryset


class EscalatedFilter(admin.SimpleListFilter):
    """Runs with an escalation ticket that is not resolved."""

    title = "escalated"
    parameter_name = "escalated"

    def lookups(self, request, model_admin):
        return [("yes", "Unresolved escalation"), ("no", "No unresolved escalation")]

    def queryset(self, request, queryset):
        # The few runs with an open ticket, by id (not an EXISTS per run: that would walk every run).
        escalated = EscalationTicket.objects.exclude(status=EscalationTicket.Status.RESOLVED).values("run_id")
        if self.value() == "yes":
            return queryset.filter(pk__in=escalated)
        if self.value() == "no":
            return queryset.exclude(pk__in=escalated)
        return queryset


class PriorityFilter(admin.SimpleListFilter):
    """Lower runs first; 100 is the default."""

    title = "priority"
    parameter_name = "priority_band"
    BANDS = {"high": {"priority__lt": 100}, "normal": {"priority": 100}, "low": {"priority__gt": 100}}

    def lookups(self, request, model_admin):
        return [("high", "High (< 100)"), ("normal", "Normal (100)"), ("low", "Low (> 100)")]

    def queryset(self, request, queryset):
        band = self.BANDS.get(self.value() or "")
        return queryset.filter(**band) if band else queryset


# --- runs -------------------------------------------------------------------------------------

@admin.register(Run)
class RunAdmin(ScaledListMixin, RunPageAdminMixin, RunPipelineAdminMixin, RunbookAdminMixin, ReadOnlyAdmin):
    # An incident's list (issue 19): status with its reason, the last error, how long in this
    # status, how long the run took, its attempt, the credits charged of the limit, its project;
    # one line per row at 1,280 px (long names cut, whole in the title). Each column is a value
    # of the row or one format_html (core.admin_rows draws them without a query per row).
    list_display = ("id", "run_name", "project_name", "status_and_reason", "error", "in_status", "duration",
                    "attempt", "credits", "escalated")
    list_filter = ("status", StuckFilter, EscalatedFilter, "failure_mode", "organization",
                   ("project", ProjectListFilter), PriorityFilter,
                   top_values_filter("last_error_code", "error code"),
                   recent_filter("status_changed_at", "status changed"), ("created_at", admin.DateFieldListFilter))
    list_select_related = ("project", "project__organization")
    search_fields = ("name", "=id", "last_error_code", "project__name", "organization__name")
    list_defer = ("plan",)
    inlines = [RunAttemptInline, EscalationInline, ApprovalRequestInline]
    # The summary at the top (status, error, age, credits, runbooks) is the page's template
    # (``admin/runs/run_change_form.html``); below it the pictures, then the long sections, collapsed.
    fieldsets = [
        ("Timeline", {"fields": ("gantt",), "classes": ("run-wide",)}),
        ("Task graph", {"fields": ("task_graph",), "classes": ("run-wide",)}),
        ("Run", {"fields": ("name", "organization", "project", "live_status_scoped", "status_reason", "priority",
                            "failure_mode", "max_agents", "attempt_number", "max_attempts", "created_by"),
                 "classes": ("collapse",)}),
        ("Credits", {"fields": ("credit_limit", "credits_reserved", "credits_charged", "credits_refunded"),
                     "classes": ("collapse",)}),
        ("Errors and timing", {"fields": ("last_error_code", "last_error", "heartbeat", "created_at",
                                          "status_changed_at", "started_at", "completed_at", "cancelled_at",
                                          "duration_ms", "replan_count", "deleted_at"), "classes": ("collapse",)}),
        ("Agents → tasks → steps", {"fields": ("hierarchy",), "classes": ("collapse", "run-wide")}),
        ("Gated pipeline", {"fields": ("pipeline_record",), "classes": ("collapse", "run-wide")}),
        ("Queued jobs: why is this waiting?", {"fields": ("waiting_jobs",), "classes": ("collapse", "run-wide")}),
        ("Ledger", {"fields": ("ledger_entries",), "classes": ("collapse", "run-wide")}),
        ("Latest events and audit trail", {"fields": ("recent_events", "audit_trail"),
                                           "classes": ("collapse", "run-wide")}),
        ("Plan", {"fields": ("plan",), "classes": ("collapse", "run-wide")}),
    ]
    readonly_fields = ("name", "organization", "project", "live_status_scoped", "status_reason", "priority",
                       "failure_mode", "max_agents", "attempt_number", "max_attempts", "created_by", "credit_limit",
                       "credits_reserved", "credits_charged", "credits_refunded", "last_error_code", "last_error",
                       "heartbeat", "created_at", "status_changed_at", "started_at", "completed_at", "cancelled_at",
                       "duration_ms", "replan_count", "deleted_at", "hierarchy", "recent_events", "audit_trail", "plan",
                       "waiting_jobs", "pipeline_record", "ledger_entries", "gantt", "task_graph")

    def get_queryset(self, request):
        # The run page reads organization, project and creator: one join instead of a query each.
        return (super().get_queryset(request).select_related("organization", "project__organization", "created_by")
                .annotate(has_open_escalation=run_escalated()))

    def list_count_parts(self, request, changelist):
        """The "stuck" list is counted as the disjoint parts of the stuck rule (each an index range,
        ``runs.selectors.run_stuck_parts``) of the list without that filter: at a million runs the
        rule as one OR is a bitmap of every live run."""
        if request.GET.get(StuckFilter.parameter_name) != "yes":
            return None
        base = changelist.get_queryset(request, exclude_parameters=[StuckFilter.parameter_name])
        return [base.filter(part).order_by(*ordering) if ordering else base.filter(part).order_by()
                for part, ordering in zip(run_stuck_parts(), RUN_STUCK_PART_ORDERINGS)]

    def get_search_results(self, request, queryset, search_term):
        """Each word of the term (as the stock admin search) must match: a run whose name or error
        code contains it (trigram indexes on PostgreSQL), whose id is it, or whose project's or
        organization's name contains it. Projects are matched in the list of projects the project
        filter reads anyway, so a word is one OR of indexed conditions on the runs table (a
        literal list of project ids), not a join across it."""
        projects = None
        for bit in smart_split(search_term):
            if bit[:1] in ('"', "'") and bit[-1:] == bit[:1]:
                bit = unescape_string_literal(bit)
            if not bit:
                continue
            if projects is None:
                projects = projects_with_organizations(request, Project._meta.ordering)
            folded = bit.casefold()
            matches = Q(name__icontains=bit) | Q(last_error_code__icontains=bit)
            matched = [project.pk for project in projects
                       if folded in project.name.casefold() or folded in project.organization.name.casefold()]
            if matched:
                matches |= Q(project_id__in=matched)
            if bit.isdigit() and int(bit) < 2**63:
                matches |= Q(pk=int(bit))
            queryset = queryset.filter(matches)
        return queryset, False

    # --- list columns ---------------------------------------------------------------------
    @admin.display(description="name", ordering="name")
    def run_name(self, run):
        return cell_truncated(run.name)

    @admin.display(description="project", ordering="project")
    def project_name(self, run):
        """The project's name, its organization in the title (the filter and search read both)."""
        project = html_text(run.project.name)
        return mark_safe(f'<span class="cell-truncate cell-narrow" title="{html_text(str(run.project))}">'
                         f'{project}</span>')

    @admin.display(description="status · reason", ordering="status")
    def status_and_reason(self, run):
        return cell_with_reason(self.live_status(run), run.status_reason)

    @admin.display(description="last error", ordering="last_error_code")
    def error(self, run):
        if not run.last_error_code:
            return ""
        return mark_safe(f'<span class="cell-truncate cell-narrow cell-error" '
                         f'title="{html_text(run.last_error[:300] or run.last_error_code)}">'
                         f'{html_text(run.last_error_code)}</span>')

    @admin.display(description="in status", ordering="status_changed_at")
    def in_status(self, run):
        return cell_since(run.status_changed_at or run.created_at, timezone.now())

    @admin.display(description="duration")
    def duration(self, run):
        """The whole run once it ended; how long it has been running so far while it is live."""
        if run.duration_ms is not None:
            return duration_label(run.duration_ms / 1000)
        if run.started_at is None:
            return "—"
        ended = (run.status_changed_at or timezone.now()) if run.status in SETTLED_RUN_STATES else timezone.now()
        return duration_label((ended - run.started_at).total_seconds())

    @admin.display(description="attempt")
    def attempt(self, run):
        return f"{run.attempt_number}/{run.max_attempts}"

    @admin.display(description="credits charged / limit")
    def credits(self, run):
        over = " cell-over" if run.credits_charged >= run.credit_limit else ""
        return mark_safe(f'<span class="cell-figure{over}" title="reserved {run.credits_reserved:d}, refunded '
                         f'{run.credits_refunded:d}">{run.credits_charged:d} / {run.credit_limit:d}</span>')

    # --- columns and fields ---------------------------------------------------------------
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

    @admin.display(description="incident")
    def escalated(self, run):
        """"open" while the run has an unresolved escalation ticket (nothing otherwise: a column of
        "no" icons would hide the few that matter)."""
        if not getattr(run, "has_open_escalation", False):
            return ""
        return mark_safe('<span class="status-badge" data-value="failed">open</span>')

    @admin.display(description="agents → tasks → steps")
    def hierarchy(self, run):
        """Every attempt's tree, in three queries whatever its size."""
        agents, tasks, steps = run_hierarchy_cached(run)
        if not agents:
            return "no agents yet (they are created when the run starts running)"
        by_attempt = defaultdict(list)
        for agent in agents:
            by_attempt[agent.attempt_number].append(agent)

        def node(status, label, detail=""):
            return format_html('<span class="run-node run-node-{}">{}</span> <strong>[{}]</strong>{}', status, label,
                               status, format_html(" — {}", detail) if detail else "")

        def step_item(step):
            detail = f"{step.kind}{' ' + step.tool if step.tool else ''}, {step.attempts} tries, " \
                     f"{step.credits_charged} credits"
            if step.last_error_code:
                detail += f", {step.last_error_code}: {step.last_error[:200]}"
            return (node(step.status, f"step {step.name}", detail),)

        def task_item(task):
            detail = ", ".join(filter(None, [task.parallelism_mode,
                                             f"after {', '.join(task.depends_on)}" if task.depends_on else "",
                                             f"{task.retry_count} retries" if task.retry_count else "",
                                             task.last_error_code]))
            return (node(task.status, f"task {task.name}", detail),
                    format_html_join("", "<li>{}</li>", (step_item(step) for step in steps[task.pk])))

        def agent_item(agent):
            detail = ", ".join(filter(None, [agent.parallelism_mode, agent.failure_mode,
                                             f"{agent.retry_count} retries" if agent.retry_count else "",
                                             agent.last_error_code]))
            return (node(agent.status, f"agent {agent.name}", detail),
                    format_html_join("", "<li>{}<ul>{}</ul></li>", (task_item(task) for task in tasks[agent.pk])))

        return format_html_join(
            "", '<div class="run-tree"><p>Attempt {}{}</p><ul>{}</ul></div>',
            ((number, " (current)" if number == run.attempt_number else "",
              format_html_join("", "<li>{}<ul>{}</ul></li>", (agent_item(agent) for agent in group)))
             for number, group in sorted(by_attempt.items(), reverse=True)))

    @admin.display(description="waiting jobs")
    def waiting_jobs(self, run):
        """The run's jobs not started yet, each with the queue's answer to "why is this waiting?"."""
        return run_waiting_jobs_html(run.pk)

    @admin.display(description="latest events")
    def recent_events(self, run):
        events = list(Event.objects.filter(run_id=run.pk).order_by("-id")[:TIMELINE_LIMIT])
        if not events:
            return "no events"
        url = reverse("admin:core_event_changelist") + f"?run_id={run.pk}"

        def summary(event):
            payload = event.payload or {}
            parts = []
            if "from" in payload or "to" in payload:
                parts.append(f"{payload.get('from') or '∅'} → {payload.get('to')}")
            error = payload.get("error")
            if isinstance(error, dict) and error.get("code"):
                parts.append(f"error {error['code']}")
            if payload.get("reason"):
                parts.append(f"reason: {payload['reason']}")
            if payload.get("actor") and payload.get("actor") != "system":
                parts.append(f"by {payload['actor']}")
            return "; ".join(parts)

        rows = format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                                ((event.pk, event.created_at.strftime("%Y-%m-%d %H:%M:%S"), event.type, summary(event))
                                 for event in events))
        return format_html('<table class="run-timeline"><thead><tr><th>#</th><th>at</th><th>event</th><th>detail</th>'
                           '</tr></thead><tbody>{}</tbody></table><p><a href="{}">all events of this run</a></p>',
                           rows, url)

    @admin.display(description="ledger entries")
    def ledger_entries(self, run):
        """The run's latest ledger entries (a run of thousands of steps has thousands of charges:
        the page shows the newest and links to all of them)."""
        entries = list(LedgerEntry.objects.filter(run_id=run.pk).order_by("-id")[:TIMELINE_LIMIT + 1])
        if not entries:
            return "no ledger entries"
        more = len(entries) > TIMELINE_LIMIT
        entries = entries[:TIMELINE_LIMIT]
        url = reverse("admin:billing_ledgerentry_changelist") + f"?run__id__exact={run.pk}"
        rows = format_html_join(
            "", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>"
                "<td>{}</td><td>{}</td></tr>",
            ((entry.created_at.strftime("%Y-%m-%d %H:%M:%S"), entry.attempt_number, entry.kind, entry.source,
              entry.amount, entry.balance_after, entry.reserved_after, entry.actor_label, entry.reason,
              entry.idempotency_key) for entry in entries))
        note = f"the latest {TIMELINE_LIMIT}; " if more else ""
        return format_html('<table class="run-ledger"><thead><tr><th>at</th><th>attempt</th><th>kind</th>'
                           '<th>source</th><th>amount</th><th>balance after</th><th>reserved after</th><th>who</th>'
                           '<th>why</th><th>idempotency key</th></tr></thead><tbody>{}</tbody></table>'
                           '<p>{}<a href="{}">all ledger entries of this run</a></p>', rows, note, url)

    @admin.display(description="audit trail")
    def audit_trail(self, run):
        records = list(AuditRecord.objects.filter(run_id=run.pk).order_by("-id")[:TIMELINE_LIMIT])
        if not records:
            return "no operator actions"

        def change(record):
            before, after = record.before or {}, record.after or {}
            if "status" in before or "status" in after:
                return f"{before.get('status') or '∅'} → {after.get('status')}"
            return ", ".join(f"{key}={value}" for key, value in after.items())

        rows = format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                                ((record.created_at.strftime("%Y-%m-%d %H:%M:%S"), record.actor_label, record.action,
                                  change(record), record.reason) for record in records))
        url = reverse("admin:core_auditrecord_changelist") + f"?run_id={run.pk}"
        return format_html('<table class="run-audit"><thead><tr><th>at</th><th>who</th><th>what</th>'
                           '<th>change</th><th>why</th></tr></thead><tbody>{}</tbody></table>'
                           '<p><a href="{}">all audit records of this run</a></p>', rows, url)


# --- escalations and approvals ----------------------------------------------------------------

@admin.register(EscalationTicket)
class EscalationTicketAdmin(RunbookAdminMixin, ReadOnlyAdmin):
    list_display = ("id", "run", "organization", "trigger", "severity", "status", "created_at", "acknowledged_by",
                    "resolved_at")
    list_filter = ("status", "trigger", "severity", "organization", recent_filter("created_at", "opened"),
                   ("created_at", admin.DateFieldListFilter))
    list_select_related = ("run", "organization", "acknowledged_by")
    search_fields = ("=id", "=run__id", "run__name", "detail", "resolution")
    show_full_result_count = False
    readonly_fields = ("run", "organization", "status", "trigger", "severity", "triggers_gathered", "detail",
                       "created_at", "acknowledged_at", "acknowledged_by", "resolved_at", "resolved_by", "resolution")
    fields = readonly_fields

    @admin.display(description="triggers")
    def triggers_gathered(self, obj: EscalationTicket):
        """Every trigger the incident gathered while it was open, oldest first."""
        rows = format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                                ((entry.get("at", ""), entry.get("trigger", ""), entry.get("detail", ""))
                                 for entry in obj.triggers))
        return format_html('<table class="escalation-triggers"><thead><tr><th>at</th><th>trigger</th>'
                           '<th>detail</th></tr></thead><tbody>{}</tbody></table>', rows)

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("run", "organization", "acknowledged_by",
                                                            "resolved_by")


@admin.register(ApprovalRequest)
class ApprovalRequestAdmin(ReadOnlyAdmin):
    list_display = ("id", "run", "attempt_number", "gate", "status", "requested_at", "approval_ref", "approved_by",
                    "approved_at")
    list_filter = ("status", recent_filter("requested_at", "requested"))
    list_select_related = ("run", "approved_by")
    search_fields = ("=run__id", "gate", "approval_ref")
    show_full_result_count = False


# --- the hierarchy, row by row ----------------------------------------------------------------

@admin.register(RunAttempt)
class RunAttemptAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "number", "credits_reserved", "credits_charged", "credits_refunded", "outcome",
                    "error_code", "created_at", "ended_at")
    list_filter = ("outcome", top_values_filter("error_code", "error code"), recent_filter("created_at", "started"))
    search_fields = ("=run__id", "error_code")
    show_full_result_count = False


@admin.register(Agent)
class AgentAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "attempt_number", "name", "status", "failure_mode", "parallelism_mode",
                    "last_error_code")
    list_filter = ("status", top_values_filter("last_error_code", "error code"))
    search_fields = ("=run__id", "name")
    show_full_result_count = False


@admin.register(Task)
class TaskAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "agent_id", "name", "status", "failure_mode", "parallelism_mode", "retry_count",
                    "last_error_code")
    list_filter = ("status", top_values_filter("last_error_code", "error code"))
    search_fields = ("=run__id", "name")
    show_full_result_count = False


@admin.register(Step)
class StepAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "task_id", "name", "kind", "tool", "status", "attempts", "credits_charged",
                    "last_error_code")
    list_filter = ("status", "kind", "tool", top_values_filter("last_error_code", "error code"))
    search_fields = ("=run__id", "name", "tool")
    show_full_result_count = False


@admin.register(StepAttempt)
class StepAttemptAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "step_id", "number", "outcome", "retryable", "cost", "error_code", "started_at",
                    "finished_at")
    list_filter = ("outcome", "retryable", top_values_filter("error_code", "error code"),
                   recent_filter("started_at", "started"))
    search_fields = ("=run__id", "idempotency_key", "error_code")
    show_full_result_count = False


@admin.register(Artifact)
class ArtifactAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "name", "storage_key", "size_bytes", "expires_at", "deleted_at")
    search_fields = ("=run__id", "name", "storage_key")
