"""Drift and resume of gated pipelines (seed 002 §6–§7).

* ``drift_acknowledge``: an operator accepts what drifted, with a reason; a pin's live value
  becomes a new pin (the old one stays in the record). Never re-pinned silently.
* ``pipeline_resume``, under the run's row lock: completed → nothing to do; failed → refused
  (retry or void it); awaiting approval → only with a valid approval, which advances it; stopped →
  the pins and the last passed gate's invariants are checked again, then the run continues from
  the next step, or stops as ``stopped_drift``. Resuming twice changes nothing.
* ``recovery_revalidate``: the same re-check for a step replayed after its worker died.
"""


from __future__ import annotations

from dataclasses import dataclass, field

from django.db import transaction
from django.utils import timezone

from core.errors import Conflict, InvalidTransition, NotFound, ValidationFailed
from core.services import actor_label, audit_record, transition_log
from runs.errors import ApprovalRequired, DriftNotPending
from runs.events import RUN_DRIFT_ACKNOWLEDGED, RUN_STOPPED
from runs.models import (
    ContextPin,
    DriftRecord,
    GateReceipt,
    Run,
    StepAttempt,
)
from runs.outbox import run_atomic, run_event_record
from runs.pipeline.bookkeeping import (
    _drift_records,
    _receipt_create,
    drift_open,
    drift_refuse_unacknowledged,
)
from runs.pipeline.checks import CheckContext, CheckResult, check_evaluate
from runs.pipeline.pins import Drift, pins_current, pins_drift, pins_values
from runs.selectors import run_last_passed_gate
from runs.services.approvals import approval_grant
from runs.services.common import _lock_run
from runs.services.lifecycle import run_pause, run_resume
from runs.services.steps import StepOutcome, step_attempt_abandon
from runs.substates import GATE_DIMENSION, StatusReason, SubState, status_reason


@run_atomic()
def drift_acknowledge(*, run_id: int, actor, reason: str, dimension: str | None = None) -> list[DriftRecord]:
    """Accept the run's open drift (every dimension, or ``dimension``) with a reason. A pin's live
    value is recorded as a new pin (actor, reason); the superseded pin stays in the run's record.
    The run stays paused: resuming it is a separate, audited step."""
    reason = (reason or "").strip()
    if not reason:
        raise ValidationFailed("a reason is required", errors={"reason": ["must not be empty"]})
    run = _lock_run(run_id)
    if run.status != Run.Status.PAUSED:  # an ended run's drift is history: nothing waits for it
        raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="acknowledge drift",
                                why="only a paused run's drift can be accepted")
    drifts = drift_open(run).order_by("id")
    if dimension:
        drifts = drifts.filter(dimension=dimension)
    drifts = list(drifts)
    if not drifts:
        raise DriftNotPending(f"run {run.pk} has no unacknowledged drift"
                              + (f" of {dimension!r}" if dimension else ""), dimension=dimension)
    now = timezone.now()
    label = actor_label(actor)
    user = actor if getattr(actor, "pk", None) else None
    current = pins_current(run)
    for drift in drifts:
        drift.status = DriftRecord.Status.ACKNOWLEDGED
        drift.acknowledged_at = now
        drift.acknowledged_by = user
        drift.actor_label = label
        drift.reason = reason
        drift.save(update_fields=["status", "acknowledged_at", "acknowledged_by", "actor_label", "reason"])
        transition_log(entity="drift", id=drift.pk, project=run.project_id, run=run.pk, attempt=drift.attempt_number,
                       dimension=drift.dimension, **{"from": DriftRecord.Status.OPEN, "to": drift.status},
                       reason=reason)
        pin = current.get(drift.dimension) if drift.kind == DriftRecord.Kind.PIN else None
        if pin is not None:
            pin.superseded_at = now
            pin.save(update_fields=["superseded_at"])
            ContextPin.objects.create(run=run, attempt_number=run.attempt_number, dimension=pin.dimension,
                                      provider=pin.provider, args=pin.args, value=drift.live, source="acknowledged",
                                      recorded_at=now, recorded_by=user, actor_label=label, reason=reason)
    summary = [{"dimension": d.dimension, "recorded": d.recorded, "live": d.live} for d in drifts]
    run_event_record(type=RUN_DRIFT_ACKNOWLEDGED, organization_id=run.organization_id, project_id=run.project_id,
                     run_id=run.pk, payload={"run": run.pk, "drift": summary, "reason": reason, "actor": label})
    audit_record(actor=actor, action="acknowledge_drift", target_type="run", target_id=run.pk,
                 organization_id=run.organization_id, run_id=run.pk, reason=reason,
                 before={"status_reason": run.status_reason, "drift": summary},
                 after={"pins": {d.dimension: d.live for d in drifts if d.kind == DriftRecord.Kind.PIN}})
    return drifts


@dataclass
class Revalidation:
    """What resuming found, computed before the run's lock is taken (checks may be slow)."""

    drifts: list[Drift] = field(default_factory=list)
    receipt: GateReceipt | None = None  # the last passed gate, re-checked
    result: CheckResult | None = None
    started_at: object = None
    finished_at: object = None


@dataclass(frozen=True)
class ResumeResult:
    run: Run
    outcome: str  # resumed | approved | nothing | stopped_drift
    detail: str = ""
    drift: list = field(default_factory=list)


def _revalidate(run: Run) -> Revalidation:
    found = Revalidation(drifts=pins_drift(run))
    if found.drifts:
        return found
    receipt = run_last_passed_gate(run)
    if receipt is None:
        return found
    accepted = DriftRecord.objects.filter(run=run, attempt_number=run.attempt_number,
                                          kind=DriftRecord.Kind.INVARIANT, status=DriftRecord.Status.ACKNOWLEDGED,
                                          dimension=f"{GATE_DIMENSION}{receipt.gate}",
                                          detected_at__gte=receipt.finished_at).exists()
    if accepted:  # an operator accepted that this gate no longer holds
        return found
    found.receipt = receipt
    found.started_at = timezone.now()
    found.result = check_evaluate(receipt.check_name, receipt.args,
                                  CheckContext(run=run, pins=pins_values(run), mode=run.mode))
    found.finished_at = timezone.now()
    return found


def pipeline_resume(*, run_id: int, actor=None, reason: str = "", gate: str | None = None,
                    approval_ref: str | None = None) -> ResumeResult:
    """Resume a run the way seed 002 §7 says (see the module's docstring)."""
    try:
        peek = Run.objects.get(pk=run_id)
    except (Run.DoesNotExist, ValueError, TypeError) as exc:
        raise NotFound(f"run {run_id} does not exist") from exc
    revalidation = None
    if (peek.gated and peek.status == Run.Status.PAUSED and not StatusReason.parse(peek.status_reason).is_(SubState.AWAITING_APPROVAL)
            and not drift_open(peek).exists()):
        revalidation = _revalidate(peek)
    with transaction.atomic():
        run = _lock_run(run_id)
        if run.status in (Run.Status.COMPLETED, Run.Status.RESUMING, Run.Status.RUNNING):
            return ResumeResult(run, "nothing", f"already {run.status}")
        if run.status == Run.Status.FAILED:
            raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="resume",
                                    why=f"it failed ({run.last_error_code}); retry it (a new attempt) or void it")
        if run.status != Run.Status.PAUSED:
            raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="resume")
        sub_state = StatusReason.parse(run.status_reason)
        if sub_state.is_(SubState.AWAITING_APPROVAL):
            waiting = sub_state.detail
            if not approval_ref:
                raise ApprovalRequired(f"run {run.pk} waits for an approval of gate {waiting!r}: resume it with "
                                       f"the gate and an approval reference", gate=waiting)
            approval_grant(run_id=run.pk, gate=gate or waiting, approval_ref=approval_ref, actor=actor,
                           reason=reason)
            return ResumeResult(_lock_run(run_id), "approved", f"gate {gate or waiting!r} approved")
        if not run.gated:
            return ResumeResult(run_resume(run_id=run.pk, actor=actor, reason=reason), "resumed")
        drift_refuse_unacknowledged(run)
        if revalidation is None:  # its state changed since we looked: look again next time
            raise Conflict(f"run {run.pk} changed while it was being checked; resume it again",
                           code="run_busy")
        stopped = _apply_revalidation(run, revalidation)
        if stopped:
            return ResumeResult(run, "stopped_drift", run.status_reason, drift=stopped)
        audit_after = {"revalidated_gate": revalidation.receipt.gate if revalidation.receipt else None}
        run = run_resume(run_id=run.pk, actor=actor, reason=reason)
        return ResumeResult(run, "resumed", ", ".join(f"{k}: {v}" for k, v in audit_after.items() if v))


def recovery_revalidate(*, run_id: int, attempt: StepAttempt) -> StepOutcome | None:
    """A step attempt replayed after its worker died (the run was "mid-phase" on disk, seed 002 §7):
    check the pins and the last passed gate again before going on. None: go on with the replay;
    otherwise the run stopped as ``stopped_drift`` and the attempt was dropped (it runs again on resume)."""
    run = Run.objects.get(pk=run_id)
    if not run.gated:
        return None
    found = _revalidate(run)
    with transaction.atomic():
        run = _lock_run(run_id)
        if run.status != Run.Status.RUNNING:
            return None  # it moved on meanwhile: the replay finds out by itself
        if not found.drifts and (found.result is None or found.result.passed):
            _apply_revalidation(run, found, before="recovery")  # the re-check's receipt
            return None
        outcome = step_attempt_abandon(attempt_id=attempt.pk)
        dimension = found.drifts[0].dimension if found.drifts else f"{GATE_DIMENSION}{found.receipt.gate}"
        run = run_pause(run_id=run.pk, status_reason=status_reason(SubState.STOPPED_DRIFT, dimension),
                                 reason="drift found when recovering an interrupted step")
        _apply_revalidation(run, found, before="recovery")
        return outcome


def _apply_revalidation(run: Run, revalidation: Revalidation, *, before: str = "resume") -> list[dict]:
    """Record what the re-check found; stop the run (its reason) on drift. Returns the drift found."""
    if revalidation.drifts:
        _drift_records(run, revalidation.drifts, before=before)
        _stop_reason(run, status_reason(SubState.STOPPED_DRIFT, revalidation.drifts[0].dimension))
        return [{"dimension": d.dimension, "recorded": d.recorded, "live": d.live} for d in revalidation.drifts]
    receipt = revalidation.receipt
    if receipt is None:
        return []
    result = revalidation.result
    _receipt_create(run, receipt.step, None, {
        "gate": receipt.gate, "check": receipt.check_name, "args": receipt.args, "invariants": result.invariants,
        "details": result.details, "passed": result.passed, "pins": pins_values(run),
        "started_at": revalidation.started_at, "finished_at": revalidation.finished_at},
        kind=GateReceipt.Kind.REVALIDATION)
    if result.passed:
        return []
    drift = Drift(f"{GATE_DIMENSION}{receipt.gate}", receipt.invariants, result.invariants)
    _drift_records(run, [drift], before=before, kind=DriftRecord.Kind.INVARIANT)
    _stop_reason(run, status_reason(SubState.STOPPED_DRIFT, drift.dimension))
    return [{"dimension": drift.dimension, "recorded": drift.recorded, "live": drift.live}]


def _stop_reason(run: Run, reason: str) -> None:
    before = run.status_reason
    if before == reason[:200]:
        return
    run.status_reason = reason[:200]
    run.save(update_fields=["status_reason", "updated_at"])
    run_event_record(type=RUN_STOPPED, organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                     payload={"run": run.pk, "status": run.status, "from": before, "status_reason": run.status_reason})

