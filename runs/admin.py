"""Admin for runs, their hierarchy, escalations and approvals: the operators' console.

Rows are read-only (they change only through the services); runbook actions (seed 001 §9)
confirm, ask for a reason, check their own permission and call ``runs.runbooks``. The run
page shows the whole story in a fixed number of queries: attempts, the agent → task → step
tree, ledger entries, escalations, approvals, the latest events and the audit trail.
"""

from __future__ import annotations

import uuid
from collections import defaultdict

from django import forms
from django.conf import settings
from django.contrib import admin
from django.db.models import Q
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.text import smart_split, unescape_string_literal

from billing.models import LedgerEntry
from core.admin import ReadOnlyAdmin, ReadOnlyInline
from core.admin_scale import ScaledListMixin
from core.admin_runbooks import (
    RunbookAdminMixin,
    RunbookForm,
    operator_permission,
    recent_filter,
    top_values_filter,
)
from core.models import AuditRecord, Event, Project
from diagnosis.admin import RunDiagnosisAdminMixin
from jobs.admin import ProjectListFilter, projects_with_organizations, run_waiting_jobs_html
from runs import runbooks
from runs.admin_pipeline import AcknowledgeDriftForm, ResumeForm, RunPipelineAdminMixin
from runs.models import (
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
from runs.selectors import run_escalated, run_stuck_q

TIMELINE_LIMIT = 50


# --- inlines on the run page ----------------------------------------------------------------

class RunAttemptInline(ReadOnlyInline):
    model = RunAttempt
    fields = ("number", "credits_reserved", "credits_charged", "credits_refunded", "outcome", "error_code",
              "created_at", "ended_at")
    readonly_fields = fields


class EscalationInline(ReadOnlyInline):
    model = EscalationTicket
    fields = ("trigger", "status", "severity", "detail", "created_at", "acknowledged_by", "acknowledged_at",
              "resolved_by", "resolved_at", "resolution")
    readonly_fields = fields

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("acknowledged_by", "resolved_by")


class ApprovalRequestInline(ReadOnlyInline):
    model = ApprovalRequest
    fields = ("attempt_number", "gate", "status", "requested_at", "approval_ref", "approved_by", "approved_at")
    readonly_fields = fields

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("approved_by")


def live_badge(kind: str, object_id, value: str, *, scope: bool = False):
    """A status that the live admin script keeps current (see core/static/orchestrator/live.js)."""
    key = "run" if kind == "run-status" else "job"
    return format_html('<span class="status-badge" data-live="{}" data-{}="{}" data-value="{}"{}>{}</span>',
                       kind, key, object_id, value,
                       format_html(' data-live-scope-run="{}"', object_id) if scope else "", value)


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


# --- runbook forms ----------------------------------------------------------------------------

class RefundForm(RunbookForm):
    amount = forms.IntegerField(min_value=1, required=False,
                                help_text="Credits to refund per run. Empty: everything charged and not yet "
                                          "refunded. Never more than was charged.")
    key = forms.CharField(widget=forms.HiddenInput, required=False, initial=lambda: uuid.uuid4().hex,
                          help_text="this confirmation's idempotency key: submitting it twice refunds once")

    def clean_key(self):
        key = (self.cleaned_data.get("key") or "").strip()
        return f"admin:{key}" if key else ""


class EscalateForm(RunbookForm):
    severity = forms.ChoiceField(choices=[(value, value) for value in ("critical", "high", "medium", "low")],
                                 initial="high")


class ApproveGateForm(RunbookForm):
    gate = forms.CharField(max_length=200, help_text="the gate the run waits for (its status reason "
                                                     "says awaiting_approval:<gate>)")
    approval_ref = forms.CharField(max_length=300, label="Approval reference",
                                   help_text="a reference no other run or gate has used (ticket, change id ...)")


class RecoverForm(RunbookForm):
    older_than_s = forms.IntegerField(min_value=0, required=False, label="Heartbeat older than (s)",
                                      help_text="a running run whose worker was silent this long is stuck")


# --- runs -------------------------------------------------------------------------------------

@admin.register(Run)
class RunAdmin(ScaledListMixin, RunPipelineAdminMixin, RunDiagnosisAdminMixin, RunbookAdminMixin, ReadOnlyAdmin):
    list_display = ("id", "name", "project", "live_status", "status_reason", "priority", "attempt_number",
                    "credits_reserved", "credits_charged", "credits_refunded", "last_error_code", "escalated",
                    "last_heartbeat", "created_at")
    list_filter = ("status", StuckFilter, EscalatedFilter, "failure_mode", "organization",
                   ("project", ProjectListFilter), PriorityFilter,
                   top_values_filter("last_error_code", "error code"),
                   recent_filter("status_changed_at", "status changed"), ("created_at", admin.DateFieldListFilter))
    list_select_related = ("project", "project__organization")
    search_fields = ("name", "=id", "last_error_code", "project__name", "organization__name")
    list_defer = ("plan",)
    inlines = [RunAttemptInline, EscalationInline, ApprovalRequestInline]
    fieldsets = [
        (None, {"fields": ("name", "organization", "project", "live_status_scoped", "status_reason", "priority",
                           "failure_mode", "max_agents", "attempt_number", "max_attempts", "created_by")}),
        ("Credits", {"fields": ("credit_limit", "credits_reserved", "credits_charged", "credits_refunded")}),
        ("Errors and timing", {"fields": ("last_error_code", "last_error", "heartbeat", "created_at",
                                          "status_changed_at", "started_at", "completed_at", "cancelled_at",
                                          "duration_ms", "replan_count", "deleted_at")}),
        ("Agents → tasks → steps", {"fields": ("hierarchy",)}),
        ("Gated pipeline", {"fields": ("pipeline_record",)}),
        ("Queued jobs: why is this waiting?", {"fields": ("waiting_jobs",)}),
        ("Ledger", {"fields": ("ledger_entries",)}),
        ("Timeline", {"fields": ("recent_events", "audit_trail")}),
        ("Plan", {"fields": ("plan",), "classes": ("collapse",)}),
    ]
    readonly_fields = ("name", "organization", "project", "live_status_scoped", "status_reason", "priority",
                       "failure_mode", "max_agents", "attempt_number", "max_attempts", "created_by", "credit_limit",
                       "credits_reserved", "credits_charged", "credits_refunded", "last_error_code", "last_error",
                       "heartbeat", "created_at", "status_changed_at", "started_at", "completed_at", "cancelled_at",
                       "duration_ms", "replan_count", "deleted_at", "hierarchy", "recent_events", "audit_trail", "plan",
                       "waiting_jobs", "pipeline_record", "ledger_entries")
    actions = ["start", "force_fail", "cancel", "pause", "resume", "retry", "refund", "escalate", "approve_gate", "recover",
               "acknowledge_drift", "void"]
    runbooks = {runbook.name: runbook for runbook in (
        runbooks.RUN_FORCE_FAIL, runbooks.RUN_CANCEL, runbooks.RUN_PAUSE, runbooks.RUN_RESUME, runbooks.RUN_RETRY,
        runbooks.RUN_REFUND, runbooks.RUN_ESCALATE, runbooks.RUN_APPROVE_GATE, runbooks.RUN_RECOVER,
        runbooks.RUN_ACKNOWLEDGE_DRIFT, runbooks.RUN_VOID)}
    runbook_forms = {"refund": RefundForm, "escalate": EscalateForm, "approve_gate": ApproveGateForm,
                     "recover": RecoverForm, "resume": ResumeForm, "acknowledge_drift": AcknowledgeDriftForm}

    def get_queryset(self, request):
        # The run page reads organization, project and creator: one join instead of a query each.
        return (super().get_queryset(request).select_related("organization", "project__organization", "created_by")
                .annotate(has_open_escalation=run_escalated()))

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

    def runbook_initial(self, runbook, objects):
        if runbook.name == "approve_gate":
            gates = {run.status_reason.split(":", 1)[1] for run in objects
                     if run.status_reason.startswith("awaiting_approval:")}
            return {"gate": gates.pop()} if len(gates) == 1 else {}
        if runbook.name == "recover":
            return {"older_than_s": settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S}
        return {}

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

    @admin.display(description="escalated", boolean=True)
    def escalated(self, run):
        return getattr(run, "has_open_escalation", None)

    @admin.display(description="agents → tasks → steps")
    def hierarchy(self, run):
        """Every attempt's tree, in three queries whatever its size."""
        agents = list(Agent.objects.filter(run=run).only(
            "pk", "run_id", "attempt_number", "sequence", "name", "status", "parallelism_mode", "failure_mode",
            "retry_count", "last_error_code").order_by("attempt_number", "sequence", "pk"))
        tasks = defaultdict(list)
        for task in Task.objects.filter(run=run).only(
                "pk", "agent_id", "sequence", "name", "status", "parallelism_mode", "depends_on", "retry_count",
                "last_error_code").order_by("agent_id", "sequence", "pk"):
            tasks[task.agent_id].append(task)
        steps = defaultdict(list)
        for step in Step.objects.filter(run=run).only(
                "pk", "task_id", "sequence", "name", "kind", "tool", "status", "attempts", "credits_charged",
                "last_error_code", "last_error").order_by("task_id", "sequence", "pk"):
            steps[step.task_id].append(step)
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

    # --- runbook actions (each: its permission, a confirmation with a reason, the service) ----
    has_start_permission = operator_permission("runs.start_run")
    has_force_fail_permission = operator_permission("runs.force_fail_run")
    has_cancel_permission = operator_permission("runs.cancel_run")
    has_pause_permission = operator_permission("runs.pause_run")
    has_resume_permission = operator_permission("runs.resume_run")
    has_retry_permission = operator_permission("runs.retry_run")
    has_refund_permission = operator_permission("billing.refund_run")
    has_escalate_permission = operator_permission("runs.escalate_run")
    has_approve_gate_permission = operator_permission("runs.approve_gate")
    has_recover_permission = operator_permission("runs.recover_run")

    @admin.action(description="Start selected runs…", permissions=["start"])
    def start(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.RUN_START)

    @admin.action(description="Force fail selected runs…", permissions=["force_fail"])
    def force_fail(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.RUN_FORCE_FAIL)

    @admin.action(description="Cancel selected runs…", permissions=["cancel"])
    def cancel(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.RUN_CANCEL)

    @admin.action(description="Pause selected runs…", permissions=["pause"])
    def pause(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.RUN_PAUSE)

    @admin.action(description="Resume selected runs…", permissions=["resume"])
    def resume(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.RUN_RESUME)

    @admin.action(description="Retry selected runs…", permissions=["retry"])
    def retry(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.RUN_RETRY)

    @admin.action(description="Refund credits of selected runs…", permissions=["refund"])
    def refund(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.RUN_REFUND)

    @admin.action(description="Escalate selected runs…", permissions=["escalate"])
    def escalate(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.RUN_ESCALATE)

    @admin.action(description="Approve a gate of selected runs…", permissions=["approve_gate"])
    def approve_gate(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.RUN_APPROVE_GATE)

    @admin.action(description="Recover selected stuck runs (heartbeat timeout)…", permissions=["recover"])
    def recover(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.RUN_RECOVER)


# --- escalations and approvals ----------------------------------------------------------------

class ResolveForm(RunbookForm):
    reason = forms.CharField(widget=forms.Textarea(attrs={"rows": 3, "cols": 80}), max_length=2000,
                             label="Resolution", error_messages={"required": "A resolution is required."},
                             help_text="What was done. Recorded as the ticket's resolution "
                                                           "and in the audit trail.")


@admin.register(EscalationTicket)
class EscalationTicketAdmin(RunbookAdminMixin, ReadOnlyAdmin):
    list_display = ("id", "run", "organization", "trigger", "severity", "status", "created_at", "acknowledged_by",
                    "resolved_at")
    list_filter = ("status", "trigger", "severity", "organization", recent_filter("created_at", "opened"),
                   ("created_at", admin.DateFieldListFilter))
    list_select_related = ("run", "organization", "acknowledged_by")
    search_fields = ("=id", "=run__id", "run__name", "detail", "resolution")
    show_full_result_count = False
    readonly_fields = ("run", "organization", "status", "trigger", "severity", "detail", "created_at",
                       "acknowledged_at", "acknowledged_by", "resolved_at", "resolved_by", "resolution")
    fields = readonly_fields
    actions = ["acknowledge", "resolve"]
    runbooks = {"acknowledge": runbooks.ESCALATION_ACKNOWLEDGE, "resolve": runbooks.ESCALATION_RESOLVE}
    runbook_forms = {"resolve": ResolveForm}

    has_acknowledge_permission = operator_permission("runs.manage_escalation")
    has_resolve_permission = operator_permission("runs.manage_escalation")

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("run", "organization", "acknowledged_by",
                                                            "resolved_by")

    @admin.action(description="Acknowledge selected escalations…", permissions=["acknowledge"])
    def acknowledge(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.ESCALATION_ACKNOWLEDGE)

    @admin.action(description="Resolve selected escalations…", permissions=["resolve"])
    def resolve(self, request, queryset):
        return self.runbook_respond(request, queryset, runbooks.ESCALATION_RESOLVE)


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
