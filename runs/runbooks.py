"""The run and escalation runbooks (seed 001 §9): one declaration each, registered by ``RunsConfig.ready``.

Each ``Runbook`` plans an action on one run (or ticket) — the state change, the credits at
stake, or why nothing would happen — and performs it through ``runs.services``, which locks
the row, re-checks the state and writes the audit record. Its declaration also gives the
admin action, button and form, the permission, and the management command with its arguments
(``core.runbooks``). Nothing here writes a row.
"""

from __future__ import annotations

import json
import uuid
from functools import partial
from pathlib import Path

from django import forms
from django.conf import settings
from django.core.management.base import CommandError
from django.utils import timezone
from django_fsm import can_proceed

from billing.models import CreditAccount
from billing.selectors import account_balance
from core.errors import ValidationFailed
from core.management.base import duration_s, whole_number
from core.runbooks import Plan, Runbook, RunbookForm, Skip, by_id, runbook_register, transition
from core.services import actor_label
from runs import services
from runs.models import (
    SETTLED_RUN_STATES,
    ApprovalRequest,
    EscalationTicket,
    PipelineKey,
    Run,
)
from runs.pipeline import bookkeeping
from runs.plan import plan_validate
from runs.selectors import run_held_credits, runs_heartbeat_stale
from runs.substates import StatusReason, SubState

FORCE_FAIL_CODE = "force_failed"
HEARTBEAT_TIMEOUT_CODE = services.HEARTBEAT_TIMEOUT_CODE


def _ended(run: Run) -> str:
    """Why nothing would happen to a run that has ended ('' while it is still live)."""
    if run.status in SETTLED_RUN_STATES:
        return f"already ended ({run.status})"
    return ""


def _held(run: Run) -> str:
    return f"{run_held_credits(run)} reserved credits held, {run.credits_charged} charged"


def _releases(run: Run) -> str:
    return f"releases {run_held_credits(run)} unused reserved credits; {run.credits_charged} charged stay charged"


def _refusal(run: Run, method_name: str) -> str:
    """Why the run's state machine will refuse the transition ('' when it allows it)."""
    if can_proceed(getattr(run, method_name)):
        return ""
    return f"not allowed from {run.status}"


def _released(before: Run, run: Run) -> str:
    """``transition``'s account of the credits a run's transition released."""
    return f"; {run.credits_refunded - before.credits_refunded} credits released"


def _by_run_id(service):
    return by_id(service, "run_id")


RunRunbook = partial(Runbook, model=Run, noun="run")
TicketRunbook = partial(Runbook, model=EscalationTicket, noun="ticket", permission="runs.manage_escalation",
                        permission_label="Can acknowledge and resolve escalations")


# --- start --------------------------------------------------------------------------------

def _start_plan(run: Run, options: dict) -> Plan:
    skip = {Run.Status.CREATED: ""}.get(run.status, f"already started ({run.status})")
    available = account_balance(organization_id=run.organization_id)["available"]
    return Plan(current=run.status, change=f"{run.status} → pending",
                credits=f"reserves {run.credit_limit} credits ({available} available)", skip=skip,
                refusal="" if skip else _refusal(run, "start"))


RUN_START = RunRunbook(
    name="start", title="Start", permission="runs.start_run", permission_label="Can start a run",
    plan=_start_plan, perform=transition(_by_run_id(services.run_start),
                                         then=lambda before, run: f"; {run.credit_limit} credits reserved"),
    button_states=(Run.Status.CREATED,), command="start_run",
    description="Start created runs: reserve credit_limit credits from their organization and queue them.")


# --- force fail ---------------------------------------------------------------------------

def _force_fail_plan(run: Run, options: dict) -> Plan:
    skip = "already failed" if run.status == Run.Status.FAILED else _ended(run)
    return Plan(current=run.status, change=f"{run.status} → failed ({FORCE_FAIL_CODE})", credits=_releases(run),
                skip=skip, refusal=_refusal(run, "fail"))


def _force_fail(run: Run, *, actor, reason: str, options: dict) -> Run:
    return services.run_fail(run_id=run.pk, code=FORCE_FAIL_CODE,
                             message=f"force-failed by {actor_label(actor)}: {reason}", actor=actor, reason=reason)


RUN_FORCE_FAIL = RunRunbook(
    name="force_fail", title="Force fail", permission="runs.force_fail_run", permission_label="Can force-fail a run",
    plan=_force_fail_plan, perform=transition(_force_fail, then=_released), command="force_fail_run",
    description="Force-fail runs (pending, running, resuming or retrying): end their agents, release unused credits.")


# --- cancel -------------------------------------------------------------------------------

def _cancel_plan(run: Run, options: dict) -> Plan:
    skip = "already cancelled" if run.status == Run.Status.CANCELLED else _ended(run)
    return Plan(current=run.status, change=f"{run.status} → cancelled", credits=_releases(run), skip=skip,
                refusal=_refusal(run, "cancel"))


RUN_CANCEL = RunRunbook(
    name="cancel", title="Cancel", permission="runs.cancel_run", permission_label="Can cancel a run",
    plan=_cancel_plan, perform=transition(_by_run_id(services.run_cancel), then=_released), command="cancel_run",
    description="Cancel runs (created, pending, running or paused): end their agents, release every credit not "
                "charged.")


# --- pause and resume ---------------------------------------------------------------------

def _pause_plan(run: Run, options: dict) -> Plan:
    skip = "already paused" if run.status == Run.Status.PAUSED else _ended(run)
    return Plan(current=run.status, change=f"{run.status} → paused", credits=_held(run) + " (nothing moves)",
                skip=skip, refusal=_refusal(run, "pause"))


RUN_PAUSE = RunRunbook(
    name="pause", title="Pause", permission="runs.pause_run", permission_label="Can pause a run",
    plan=_pause_plan, perform=transition(_by_run_id(services.run_pause)), command="pause_run",
    description="Pause running runs: no new work starts until they are resumed (credits stay reserved).")


def _current(run: Run) -> str:
    return f"{run.status} ({run.status_reason})" if run.status_reason else run.status


def _resume_plan(run: Run, options: dict) -> Plan:
    """Seed 002 §7: completed → nothing to do; failed → refused; awaiting approval → only with an
    approval reference; stopped on drift → only once acknowledged; a gated run's pins and last
    passed gate are checked again before it goes on."""
    skip = refusal = warning = ""
    change = f"{run.status} → resuming"
    if run.status in (Run.Status.RESUMING, Run.Status.RUNNING, Run.Status.COMPLETED):
        skip = f"already {run.status}"
    elif run.status == Run.Status.FAILED:
        refusal = f"it failed ({run.last_error_code}): retry it (a new attempt) or void it"
    elif run.status == Run.Status.CANCELLED:
        skip = _ended(run)
    else:
        refusal = _refusal(run, "resume")
    if not skip and not refusal and StatusReason.parse(run.status_reason).is_(SubState.AWAITING_APPROVAL):
        gate = StatusReason.parse(run.status_reason).detail
        ref = options.get("approval_ref") or ""
        if not ref:
            refusal = f"waiting for an approval of gate {gate!r}: give its approval reference (or approve the gate)"
        else:
            change = f"gate {options.get('gate') or gate!r} approved with {ref!r}; {run.status} → resuming"
    elif not skip and not refusal and run.gated:
        drift = bookkeeping.drift_open(run).order_by("id").first()
        if drift is not None:
            refusal = (f"stopped on drift of {drift.dimension!r} (recorded {drift.recorded!r}, live {drift.live!r}): "
                       "acknowledge it first")
        else:
            warning = "the pins and the last passed gate are checked again first; drift stops the run again"
    return Plan(current=_current(run), change=change, credits=_held(run) + " (nothing moves)", skip=skip,
                refusal=refusal, warning=warning)


def _resume(run: Run, *, actor, reason: str, options: dict) -> str:
    before = _current(run)
    result = services.pipeline_resume(run_id=run.pk, actor=actor, reason=reason, gate=options.get("gate") or None,
                                   approval_ref=options.get("approval_ref") or None)
    if result.outcome == "nothing":
        raise Skip(result.detail)
    if result.outcome == "stopped_drift":  # recorded and committed: the run stays stopped
        raise services.DriftDetected(f"not resumed: {result.detail} (" + "; ".join(
            f"{d['dimension']}: recorded {d['recorded']!r}, live {d['live']!r}" for d in result.drift) + ")")
    run.refresh_from_db()
    return f"{before} → {run.status}" + (f"; {result.detail}" if result.detail else "")


class ResumeForm(RunbookForm):
    gate = forms.CharField(max_length=200, required=False,
                           help_text="a run awaiting approval: the gate (default: the one it waits for)")
    approval_ref = forms.CharField(max_length=300, required=False, label="Approval reference",
                                   help_text="a run awaiting approval: a reference no other run or gate has used")


def _resume_arguments(parser) -> None:
    parser.add_argument("--gate", default="", help="the gate a run awaiting approval waits for (default: its own)")
    parser.add_argument("--approval-ref", default="", dest="approval_ref",
                        help="the approval reference for a run awaiting approval (used by no other run or gate)")


def _resume_options(options: dict) -> dict:
    gate, ref = (options["gate"] or "").strip(), (options["approval_ref"] or "").strip()
    if gate and not ref:
        raise CommandError("--gate needs --approval-ref")
    return {"gate": gate, "approval_ref": ref}


RUN_RESUME = RunRunbook(
    name="resume", title="Resume", permission="runs.resume_run", permission_label="Can resume a run",
    plan=_resume_plan, perform=_resume, option_names=("gate", "approval_ref"), form=ResumeForm,
    command="resume_run", arguments=_resume_arguments, command_options=_resume_options,
    description="Resume paused runs (seed 002 §7): a completed run is left alone, a failed one refused; a gated "
                "run's pins and last passed gate are checked again first (drift stops it again); a run awaiting "
                "approval resumes only with --approval-ref (its gate, or --gate), a run stopped on drift only once "
                "acknowledged.")


# --- acknowledge drift and void (gated pipelines) ------------------------------------------

def _acknowledge_drift_plan(run: Run, options: dict) -> Plan:
    open_drift = bookkeeping.drift_open(run).order_by("id")
    if options.get("dimension"):
        open_drift = open_drift.filter(dimension=options["dimension"])
    found = list(open_drift)
    skip = "" if found else "no unacknowledged drift" + (f" of {options['dimension']!r}"
                                                         if options.get("dimension") else "")
    what = "; ".join(f"{d.dimension}: recorded {d.recorded!r} → live {d.live!r}" for d in found)
    return Plan(current=_current(run),
                change=f"acknowledges {what or 'nothing'} (a pin takes its live value; the run stays {run.status})",
                credits=_held(run) + " (nothing moves)", skip=skip)


def _acknowledge_drift(run: Run, *, actor, reason: str, options: dict) -> str:
    drifts = services.drift_acknowledge(run_id=run.pk, actor=actor, reason=reason,
                                     dimension=options.get("dimension") or None)
    return "acknowledged " + ", ".join(d.dimension for d in drifts) + "; resume the run to continue"


class AcknowledgeDriftForm(RunbookForm):
    dimension = forms.CharField(max_length=250, required=False,
                                help_text="acknowledge this dimension only (empty: every unacknowledged drift)")


def _acknowledge_drift_arguments(parser) -> None:
    parser.add_argument("--dimension", default="", help="acknowledge this dimension only (default: all)")


RUN_ACKNOWLEDGE_DRIFT = RunRunbook(
    name="acknowledge_drift", title="Acknowledge drift", permission="runs.acknowledge_drift",
    permission_label="Can acknowledge the drift of a run's pins", plan=_acknowledge_drift_plan,
    perform=_acknowledge_drift, option_names=("dimension",), form=AcknowledgeDriftForm,
    action_label="Acknowledge the drift of selected runs…", command="acknowledge_drift",
    arguments=_acknowledge_drift_arguments,
    command_options=lambda options: {"dimension": (options["dimension"] or "").strip()},
    description="Acknowledge the drift runs stopped on (stopped_drift:<dimension>): a pin's live value becomes the "
                "pin, the old one stays in the record. The runs stay paused: resume them with resume_run.")


def _void_plan(run: Run, options: dict) -> Plan:
    skip = refusal = ""
    if run.status == Run.Status.CANCELLED and StatusReason.parse(run.status_reason).is_(SubState.VOIDED):
        skip = f"already voided ({run.status_reason})"
    elif run.status not in (Run.Status.PAUSED, Run.Status.FAILED):
        refusal = f"only a stopped run (paused or failed) can be voided; it is {run.status}"
    keys = PipelineKey.objects.filter(run=run, released_at__isnull=True).count()
    pending = ApprovalRequest.objects.filter(run=run, status=ApprovalRequest.Status.PENDING).count()
    return Plan(current=_current(run),
                change=f"{run.status} → cancelled (voided:<reason>); releases {keys} phase keys, voids {pending} "
                       "pending approvals",
                credits=_releases(run), skip=skip, refusal=refusal)


RUN_VOID = RunRunbook(
    name="void", title="Void", permission="runs.void_run", permission_label="Can void a stopped run",
    plan=_void_plan, perform=transition(_by_run_id(services.run_void),
                                        then=lambda before, run: f" ({run.status_reason}){_released(before, run)}",
                                        skip=lambda run: f"already voided ({run.status_reason})"),
    action_label="Void selected stopped runs…", command="void_run",
    description="Void stopped runs (paused or failed): they end cancelled with the reason voided:<reason>, their "
                "phase idempotency keys are released, pending approvals voided and unused reserved credits "
                "refunded.")


# --- retry --------------------------------------------------------------------------------

def _retry_plan(run: Run, options: dict) -> Plan:
    if run.status == Run.Status.RETRYING:
        skip = "already retrying"
    elif run.status in (Run.Status.COMPLETED, Run.Status.CANCELLED):
        skip = f"already ended ({run.status})"
    else:
        skip = ""
    available = account_balance(organization_id=run.organization_id)["available"]
    refusal = _refusal(run, "retry")
    if run.status == Run.Status.FAILED and not run.has_attempts_left():
        refusal = f"attempts exhausted ({run.attempt_number} of {run.max_attempts})"
    if not refusal and available < run.credit_limit:
        refusal = f"only {available} credits available"
    if not refusal and options.get("plan") is not None and run.gated:
        refusal = "a gated run's plan is its contract: it cannot be edited"
    return Plan(current=run.status,
                change=f"{run.status} → retrying (attempt {run.attempt_number + 1} of {run.max_attempts})",
                credits=f"reserves {run.credit_limit} credits for the new attempt ({available} available)",
                skip=skip, refusal=refusal)


def _edited_plan(text: str) -> dict | None:
    """An edited plan as JSON text, validated like a new run's (``ValueError`` says what is wrong)."""
    if not (text or "").strip():
        return None
    try:
        plan = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the plan is not valid JSON: {exc}") from exc
    try:
        return plan_validate(plan)
    except ValidationFailed as exc:
        raise ValueError("; ".join(f"{path}: {', '.join(map(str, msgs))}" for path, msgs in exc.errors.items()))


class RetryForm(RunbookForm):
    plan = forms.CharField(widget=forms.Textarea(attrs={"rows": 12, "cols": 80}), required=False,
                           help_text="optional: an edited plan (JSON) for the new attempt; not for gated runs")

    def clean_plan(self):
        try:
            return _edited_plan(self.cleaned_data.get("plan") or "")
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from exc


def _retry_options(options: dict) -> dict:
    if not options["plan_file"]:
        return {"plan": None}
    try:
        return {"plan": _edited_plan(Path(options["plan_file"]).read_text())}
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CommandError(f"--plan-file {options['plan_file']}: {exc}") from exc


RUN_RETRY = RunRunbook(
    name="retry", title="Retry", permission="runs.retry_run", permission_label="Can retry a run",
    plan=_retry_plan, perform=transition(
        lambda run, *, actor, reason, options: services.run_retry(run_id=run.pk, actor=actor, reason=reason,
                                                                  plan=options.get("plan")),
        then=lambda before, run: f"; attempt {run.attempt_number} reserved {run.credit_limit} credits"),
    option_names=("plan",), form=RetryForm, command="retry_run",
    arguments=lambda parser: parser.add_argument("--plan-file", help="an edited plan (JSON) for the new attempt"),
    command_options=_retry_options,
    description="Retry failed runs with attempts left: a new attempt with a new reservation of credit_limit credits, "
                "optionally running an edited plan (not for gated runs: their plan is their contract).")


# --- refund -------------------------------------------------------------------------------

def _refund_plan(run: Run, options: dict) -> Plan:
    amount = options.get("amount")
    charged = run.credits_charged
    skip = ""
    if run.status in SETTLED_RUN_STATES and charged == 0:
        skip = "nothing charged left to refund"
    refusal = ""
    if run.status not in SETTLED_RUN_STATES:
        refusal = f"the run is {run.status}: only completed, failed or cancelled runs can be refunded"
    elif amount is not None and amount > charged:
        refusal = f"{amount} is more than the {charged} charged and not yet refunded"
    what = f"{amount if amount is not None else charged} of {charged} charged credits"
    return Plan(current=run.status, change=f"credits only (stays {run.status})", credits=f"refunds {what}",
                skip=skip, refusal=refusal)


def _refund(run: Run, *, actor, reason: str, options: dict) -> str:
    amount = services.run_refund(run_id=run.pk, amount=options.get("amount"), actor=actor, reason=reason,
                                 idempotency_key=options.get("key") or None)
    if amount == 0:
        raise Skip("already refunded under this idempotency key")
    run.refresh_from_db()
    return f"refunded {amount} credits ({run.credits_charged} still charged)"


class RefundForm(RunbookForm):
    amount = forms.IntegerField(min_value=1, required=False,
                                help_text="Credits to refund per run. Empty: everything charged and not yet "
                                          "refunded. Never more than was charged.")
    key = forms.CharField(widget=forms.HiddenInput, required=False, initial=lambda: uuid.uuid4().hex,
                          help_text="this confirmation's idempotency key: submitting it twice refunds once")

    def clean_key(self):
        key = (self.cleaned_data.get("key") or "").strip()
        return f"admin:{key}" if key else ""


def _refund_arguments(parser) -> None:
    parser.add_argument("--amount", type=int, help="credits per run (default: everything still charged)")
    parser.add_argument("--key", help="idempotency key: repeating the command with it refunds once")


def _refund_options(options: dict) -> dict:
    if options["amount"] is not None and options["amount"] <= 0:
        raise CommandError("--amount must be a whole number greater than zero")
    key = (options["key"] or "").strip()
    return {"amount": options["amount"], "key": f"cli:{key}" if key else None}


RUN_REFUND = RunRunbook(
    name="refund", title="Refund credits", permission="billing.refund_run", permission_model=CreditAccount,
    permission_label="Can refund credits of a run", plan=_refund_plan, perform=_refund,
    option_names=("amount", "key"), form=RefundForm, action_label="Refund credits of selected runs…",
    command="refund_run", arguments=_refund_arguments, command_options=_refund_options,
    command_example="--amount {amount}",
    description="Refund charged credits of completed, failed or cancelled runs: everything charged, or --amount "
                "per run (never more than charged minus refunded).")


# --- approve a gate -----------------------------------------------------------------------

def _approve_plan(run: Run, options: dict) -> Plan:
    gate, ref = options.get("gate") or "", options.get("approval_ref") or ""
    skip = ""
    if ref and ApprovalRequest.objects.filter(run=run, attempt_number=run.attempt_number, gate=gate,
                                              approval_ref=ref).exists():
        skip = f"gate {gate!r} already approved with reference {ref!r}"
    elif run.status in SETTLED_RUN_STATES:
        skip = _ended(run)
    refusal = ""
    if not StatusReason.parse(run.status_reason).is_(SubState.AWAITING_APPROVAL, gate):
        refusal = f"not waiting for gate {gate!r} ({run.status_reason or run.status})"
    return Plan(current=f"{run.status} ({run.status_reason})" if run.status_reason else run.status,
                change=f"gate {gate!r} approved with {ref!r}; {run.status} → resuming", credits=_held(run),
                skip=skip, refusal=refusal)


def _approve(run: Run, *, actor, reason: str, options: dict) -> str:
    gate, ref = options.get("gate") or "", options.get("approval_ref") or ""
    before = run.status
    request = services.approval_grant(run_id=run.pk, gate=gate, approval_ref=ref, actor=actor, reason=reason)
    run.refresh_from_db()
    return f"gate {request.gate!r} approved ({ref}); {before} → {run.status}"


class ApproveGateForm(RunbookForm):
    gate = forms.CharField(max_length=200, help_text="the gate the run waits for (its status reason "
                                                     "says awaiting_approval:<gate>)")
    approval_ref = forms.CharField(max_length=300, label="Approval reference",
                                   help_text="a reference no other run or gate has used (ticket, change id ...)")


def _approve_initial(runs: list) -> dict:
    """The gate, when every selected run waits for the same one."""
    gates = {StatusReason.parse(run.status_reason).detail for run in runs
             if StatusReason.parse(run.status_reason).is_(SubState.AWAITING_APPROVAL)}
    return {"gate": gates.pop()} if len(gates) == 1 else {}


def _approve_arguments(parser) -> None:
    parser.add_argument("--gate", required=True, help="the gate's name")
    parser.add_argument("--ref", required=True, help="the approval reference (unique across runs and gates)")


def _approve_options(options: dict) -> dict:
    gate, ref = (options["gate"] or "").strip(), (options["ref"] or "").strip()
    if not gate or not ref:
        raise CommandError("--gate and --ref must not be empty")
    return {"gate": gate, "approval_ref": ref}


RUN_APPROVE_GATE = RunRunbook(
    name="approve_gate", title="Approve a gate", permission="runs.approve_gate", permission_label="Can approve a gate",
    plan=_approve_plan, perform=_approve, option_names=("gate", "approval_ref"), form=ApproveGateForm,
    initial=_approve_initial, action_label="Approve a gate of selected runs…", command="approve_gate", many=False,
    arguments=_approve_arguments, command_options=_approve_options, command_example="--gate {gate} --ref REF",
    description="Approve a gate a run waits for (status reason awaiting_approval:<gate>) with an approval reference "
                "no other run or gate has used; the run resumes.")


# --- recover a stuck run (seed 001 §9.1) -------------------------------------------------

def _heartbeat_age_s(run: Run) -> int | None:
    seen = run.last_heartbeat or run.status_changed_at
    return None if seen is None else int((timezone.now() - seen).total_seconds())


def _older_than(options: dict) -> int:
    value = options.get("older_than_s")
    return settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S if value is None else value


def _recover_plan(run: Run, options: dict) -> Plan:
    older_than = _older_than(options)
    age = _heartbeat_age_s(run)
    seen = "never" if age is None else f"{age} s ago"
    skip = ""
    if run.status != Run.Status.RUNNING:
        skip = f"not running ({run.status})"
    elif not runs_heartbeat_stale(older_than_s=older_than).filter(pk=run.pk).exists():
        skip = f"not stuck: last heartbeat {seen}, or its work is waiting in the queue (threshold {older_than} s)"
    return Plan(current=f"{run.status} (last heartbeat {seen})",
                change=f"agents terminated; {run.status} → failed ({HEARTBEAT_TIMEOUT_CODE})",
                credits=_releases(run), skip=skip)


def _recover(run: Run, *, actor, reason: str, options: dict) -> Run:
    try:
        return services.run_recover(run_id=run.pk, older_than_s=_older_than(options), actor=actor, reason=reason)
    except services.RunNotStuck as exc:
        raise Skip(f"not stuck any more: {exc.detail.split(': ', 1)[-1]}") from exc


class RecoverForm(RunbookForm):
    older_than_s = forms.IntegerField(min_value=0, required=False, label="Heartbeat older than (s)",
                                      help_text="a running run whose worker was silent this long is stuck")


def _recover_arguments(parser) -> None:
    parser.add_argument("--older-than", help="silence that makes a run stuck: 90, 90s, 5m, 2h, 1d "
                                             "(default: ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S)")
    parser.add_argument("--limit", type=whole_number(1, 1_000_000), default=1000,
                        help="recover at most this many runs (default 1000)")


def _recover_options(options: dict) -> dict:
    older_than = options["older_than"]
    return {"older_than_s": settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S if older_than is None
            else duration_s(older_than, option="--older-than")}


RUN_RECOVER = RunRunbook(
    name="recover", title="Recover stuck runs", permission="runs.recover_run",
    permission_label="Can recover stuck runs", plan=_recover_plan,
    perform=transition(_recover, then=lambda before, run: f" ({HEARTBEAT_TIMEOUT_CODE}){_released(before, run)}"),
    option_names=("older_than_s",), form=RecoverForm,
    initial=lambda runs: {"older_than_s": settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S},
    button_states=(Run.Status.RUNNING,), action_label="Recover selected stuck runs (heartbeat timeout)…",
    command="recover_stuck_runs", arguments=_recover_arguments, command_options=_recover_options,
    targets=lambda options, runbook_options: runs_heartbeat_stale(
        older_than_s=runbook_options["older_than_s"])[:options["limit"]],
    description="Recover stuck runs (seed 001 §9.1): fail running runs without a worker heartbeat for --older-than "
                "with heartbeat_timeout, terminating their agents and refunding the unused reservation.")



RUNBOOKS = (RUN_START, RUN_FORCE_FAIL, RUN_CANCEL, RUN_PAUSE, RUN_RESUME, RUN_RETRY, RUN_REFUND,
            RUN_APPROVE_GATE, RUN_RECOVER, RUN_ACKNOWLEDGE_DRIFT, RUN_VOID)


def runbooks_register() -> None:
    """``RunsConfig.ready``: the run runbooks join the registry, in this order."""
    for runbook in RUNBOOKS:
        runbook_register(runbook)
