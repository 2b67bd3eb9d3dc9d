"""The run and escalation runbooks (seed 001 §9) for the admin actions and the commands.

Each ``Runbook`` plans an action on one run (or ticket) — the state change, the credits at
stake, or why nothing would happen — and performs it through ``runs.services``,
``runs.escalations`` or ``runs.gates``, which lock the row, re-check the state and write the
audit record. Nothing here writes a row.
"""

from __future__ import annotations

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django_fsm import can_proceed

from billing.selectors import account_balance
from core.runbooks import Plan, Runbook, Skip
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
from runs.selectors import run_held_credits, run_open_escalation, runs_heartbeat_stale
from runs.services import escalations
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


def _released_since(run: Run, refunded_before: int) -> str:
    return f"{run.credits_refunded - refunded_before} credits released"


# --- start --------------------------------------------------------------------------------

def _start_plan(run: Run, options: dict) -> Plan:
    skip = {Run.Status.CREATED: ""}.get(run.status, f"already started ({run.status})")
    available = account_balance(organization_id=run.organization_id)["available"]
    return Plan(current=run.status, change=f"{run.status} → pending",
                credits=f"reserves {run.credit_limit} credits ({available} available)", skip=skip,
                refusal="" if skip else _refusal(run, "start"))


def _start(run: Run, *, actor, reason: str, options: dict) -> str:
    before = run.status
    run = services.run_start(run_id=run.pk, actor=actor, reason=reason)
    if before == run.status:
        raise Skip(f"already {run.status}")
    return f"{before} → {run.status}; {run.credit_limit} credits reserved"


RUN_START = Runbook(name="start", title="Start", permission="runs.start_run", plan=_start_plan, perform=_start)


# --- force fail ---------------------------------------------------------------------------

def _force_fail_plan(run: Run, options: dict) -> Plan:
    skip = "already failed" if run.status == Run.Status.FAILED else _ended(run)
    return Plan(current=run.status, change=f"{run.status} → failed ({FORCE_FAIL_CODE})", credits=_releases(run),
                skip=skip, refusal=_refusal(run, "fail"))


def _force_fail(run: Run, *, actor, reason: str, options: dict) -> str:
    before, refunded = run.status, run.credits_refunded
    run = services.run_fail(run_id=run.pk, code=FORCE_FAIL_CODE,
                            message=f"force-failed by {actor_label(actor)}: {reason}", actor=actor, reason=reason)
    if before == run.status:
        raise Skip(f"already {run.status}")
    return f"{before} → {run.status}; {_released_since(run, refunded)}"


RUN_FORCE_FAIL = Runbook(name="force_fail", title="Force fail", permission="runs.force_fail_run",
                         plan=_force_fail_plan, perform=_force_fail)


# --- cancel -------------------------------------------------------------------------------

def _cancel_plan(run: Run, options: dict) -> Plan:
    skip = "already cancelled" if run.status == Run.Status.CANCELLED else _ended(run)
    return Plan(current=run.status, change=f"{run.status} → cancelled", credits=_releases(run), skip=skip,
                refusal=_refusal(run, "cancel"))


def _cancel(run: Run, *, actor, reason: str, options: dict) -> str:
    before, refunded = run.status, run.credits_refunded
    run = services.run_cancel(run_id=run.pk, actor=actor, reason=reason)
    if before == run.status:
        raise Skip(f"already {run.status}")
    return f"{before} → {run.status}; {_released_since(run, refunded)}"


RUN_CANCEL = Runbook(name="cancel", title="Cancel", permission="runs.cancel_run", plan=_cancel_plan,
                     perform=_cancel)


# --- pause and resume ---------------------------------------------------------------------

def _pause_plan(run: Run, options: dict) -> Plan:
    skip = "already paused" if run.status == Run.Status.PAUSED else _ended(run)
    return Plan(current=run.status, change=f"{run.status} → paused", credits=_held(run) + " (nothing moves)",
                skip=skip, refusal=_refusal(run, "pause"))


def _pause(run: Run, *, actor, reason: str, options: dict) -> str:
    before = run.status
    run = services.run_pause(run_id=run.pk, actor=actor, reason=reason)
    if before == run.status:
        raise Skip(f"already {run.status}")
    return f"{before} → {run.status}"


RUN_PAUSE = Runbook(name="pause", title="Pause", permission="runs.pause_run", plan=_pause_plan, perform=_pause)


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


RUN_RESUME = Runbook(name="resume", title="Resume", permission="runs.resume_run", plan=_resume_plan,
                     perform=_resume, option_names=("gate", "approval_ref"))


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


RUN_ACKNOWLEDGE_DRIFT = Runbook(name="acknowledge_drift", title="Acknowledge drift",
                                permission="runs.acknowledge_drift", plan=_acknowledge_drift_plan,
                                perform=_acknowledge_drift, option_names=("dimension",))


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


def _void(run: Run, *, actor, reason: str, options: dict) -> str:
    before, refunded = run.status, run.credits_refunded
    run = services.run_void(run_id=run.pk, actor=actor, reason=reason)
    if before == run.status:
        raise Skip(f"already voided ({run.status_reason})")
    return f"{before} → {run.status} ({run.status_reason}); {_released_since(run, refunded)}"


RUN_VOID = Runbook(name="void", title="Void", permission="runs.void_run", plan=_void_plan, perform=_void)


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
    return Plan(current=run.status,
                change=f"{run.status} → retrying (attempt {run.attempt_number + 1} of {run.max_attempts})",
                credits=f"reserves {run.credit_limit} credits for the new attempt ({available} available)",
                skip=skip, refusal=refusal)


def _retry(run: Run, *, actor, reason: str, options: dict) -> str:
    before = run.status
    run = services.run_retry(run_id=run.pk, actor=actor, reason=reason)
    if before == run.status:
        raise Skip(f"already {run.status}")
    return f"{before} → {run.status}; attempt {run.attempt_number} reserved {run.credit_limit} credits"


RUN_RETRY = Runbook(name="retry", title="Retry", permission="runs.retry_run", plan=_retry_plan, perform=_retry)


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


RUN_REFUND = Runbook(name="refund", title="Refund credits", permission="billing.refund_run", plan=_refund_plan,
                     perform=_refund, option_names=("amount", "key"))


# --- escalate -----------------------------------------------------------------------------

def _escalate_plan(run: Run, options: dict) -> Plan:
    ticket = run_open_escalation(run=run, trigger=EscalationTicket.Trigger.MANUAL)
    skip = f"already escalated (ticket {ticket.pk}, {ticket.status})" if ticket else ""
    return Plan(current=run.status, change=f"opens a manual escalation ticket (run stays {run.status})",
                credits=_held(run), skip=skip)


def _escalate(run: Run, *, actor, reason: str, options: dict) -> str:
    with transaction.atomic():
        ticket, created = escalations.escalation_open(run=run, trigger=EscalationTicket.Trigger.MANUAL,
                                                      detail=reason, actor=actor, reason=reason,
                                                      severity=options.get("severity") or "high")
    if not created:
        raise Skip(f"already escalated (ticket {ticket.pk}, {ticket.status})")
    return f"opened escalation ticket {ticket.pk}"


RUN_ESCALATE = Runbook(name="escalate", title="Escalate", permission="runs.escalate_run", plan=_escalate_plan,
                       perform=_escalate, option_names=("severity",))


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


RUN_APPROVE_GATE = Runbook(name="approve_gate", title="Approve a gate", permission="runs.approve_gate",
                           plan=_approve_plan, perform=_approve, option_names=("gate", "approval_ref"))


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


def _recover(run: Run, *, actor, reason: str, options: dict) -> str:
    before, refunded = run.status, run.credits_refunded
    try:
        run = services.run_recover(run_id=run.pk, older_than_s=_older_than(options), actor=actor, reason=reason)
    except services.RunNotStuck as exc:
        raise Skip(f"not stuck any more: {exc.detail.split(': ', 1)[-1]}") from exc
    if before == run.status:
        raise Skip(f"already {run.status}")
    return f"{before} → {run.status} ({HEARTBEAT_TIMEOUT_CODE}); {_released_since(run, refunded)}"


RUN_RECOVER = Runbook(name="recover", title="Recover stuck runs", permission="runs.recover_run",
                      plan=_recover_plan, perform=_recover, option_names=("older_than_s",))


# --- escalation tickets -------------------------------------------------------------------

def _ticket_credits(ticket: EscalationTicket) -> str:
    run = ticket.run
    return f"run {run.pk} ({run.status}): {_held(run)}"


def _acknowledge_plan(ticket: EscalationTicket, options: dict) -> Plan:
    skip = f"already {ticket.status}" if ticket.status != EscalationTicket.Status.OPEN else ""
    return Plan(current=ticket.status, change=f"{ticket.status} → acknowledged", credits=_ticket_credits(ticket),
                skip=skip)


def _acknowledge(ticket: EscalationTicket, *, actor, reason: str, options: dict) -> str:
    before = ticket.status
    ticket = escalations.escalation_acknowledge(ticket_id=ticket.pk, actor=actor, reason=reason)
    if before == ticket.status:
        raise Skip(f"already {ticket.status}")
    return f"{before} → {ticket.status}"


ESCALATION_ACKNOWLEDGE = Runbook(name="acknowledge", title="Acknowledge", permission="runs.manage_escalation",
                                 plan=_acknowledge_plan, perform=_acknowledge)


def _resolve_plan(ticket: EscalationTicket, options: dict) -> Plan:
    skip = "already resolved" if ticket.status == EscalationTicket.Status.RESOLVED else ""
    return Plan(current=ticket.status, change=f"{ticket.status} → resolved (the reason is the resolution)",
                credits=_ticket_credits(ticket), skip=skip)


def _resolve(ticket: EscalationTicket, *, actor, reason: str, options: dict) -> str:
    before = ticket.status
    ticket = escalations.escalation_resolve(ticket_id=ticket.pk, actor=actor, reason=reason)
    if before == ticket.status:
        raise Skip(f"already {ticket.status}")
    return f"{before} → {ticket.status}"


ESCALATION_RESOLVE = Runbook(name="resolve", title="Resolve", permission="runs.manage_escalation",
                             plan=_resolve_plan, perform=_resolve)
