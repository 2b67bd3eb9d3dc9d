"""Gate steps, drift and resume of gated pipelines (DESIGN §4, seed 002 §2–§8).

* ``check`` steps (internal gates): the run's pins are recomputed first (any difference stops
  the run as ``stopped_drift:<dimension>``); then the named check judges its invariants. A pass
  records a ``GateReceipt`` on the phase, in the same transaction as the step's success; a
  failure records the receipt and fails the run with ``gate_failed:<gate>`` and the broken
  invariant, whatever the failure modes say (gates fail closed).
* ``approval`` steps (sovereign gates): an ``ApprovalRequest`` (what is asked, the pins then) and
  the run pauses as ``awaiting_approval:<gate>``; ``approval_grant`` validates an approval (the
  gate is pending for this run, the reference was never used by any run or gate) and resumes.
* ``drift_acknowledge``: an operator accepts what drifted, with a reason; a pin's live value
  becomes a new pin (the old one stays in the record). Never re-pinned silently.
* ``pipeline_resume`` (seed 002 §7), under the run's row lock: completed → nothing to do; failed
  → refused (retry or void it); awaiting approval → only with a valid approval, which advances
  it; stopped → the pins and the last passed gate's invariants are checked again, then the run
  continues from the next step, or stops as ``stopped_drift``. Resuming twice changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db import IntegrityError, transaction
from django.utils import timezone

from core.errors import Conflict, InvalidTransition, NotFound, ValidationFailed
from core.services import actor_label, audit_record, event_record, transition_log
from runs import services
from runs.checks import CheckContext, CheckResult, check_args, check_evaluate
from runs.models import (
    ApprovalRequest,
    ContextPin,
    DriftRecord,
    GateReceipt,
    Run,
    Step,
    StepAttempt,
)
from runs.pins import Drift, pins_current, pins_drift, pins_values
from runs.pipeline import drift_open, drift_refuse_unacknowledged, phase_of_step

AWAITING_APPROVAL = "awaiting_approval:"
STOPPED_DRIFT = "stopped_drift:"
GATE_DIMENSION = "gate:"


class ApprovalReused(Conflict):
    code = "approval_reused"


class ApprovalNotPending(Conflict):
    code = "approval_not_pending"


class ApprovalRequired(Conflict):
    """The run waits for an approval: resuming it needs the gate's approval reference."""

    code = "approval_required"


class DriftNotPending(Conflict):
    """There is no unacknowledged drift on the run."""

    code = "drift_not_pending"


class DriftDetected(Conflict):
    """Resuming found drift: the run stays stopped as ``stopped_drift:<dimension>``."""

    code = "drift_detected"


def gate_name(step: Step) -> str:
    return (step.args or {}).get("gate") or step.name


def gate_execute(*, step: Step, attempt: StepAttempt) -> services.StepOutcome:
    """Execute a gate step's attempt (called by the ``run_step`` job)."""
    if step.kind == Step.Kind.APPROVAL:
        return _approval_execute(step=step, attempt=attempt)
    if step.kind == Step.Kind.CHECK:
        return _check_execute(step=step, attempt=attempt)
    return services.step_attempt_fail(attempt_id=attempt.pk, code="unknown_gate_kind",
                                      message=f"step kind {step.kind!r} cannot run here", retryable=False)


# --- internal gates ----------------------------------------------------------------------------

def _check_execute(*, step: Step, attempt: StepAttempt) -> services.StepOutcome:
    run = Run.objects.get(pk=step.run_id)
    gate = gate_name(step)
    drifts = pins_drift(run)  # reads only: outside the transaction
    if drifts:
        return _stop_on_drift(run_id=run.pk, attempt=attempt, drifts=drifts, before=gate)
    pins = pins_values(run)
    started = timezone.now()
    result = check_evaluate(step.args.get("check", ""), check_args(step.args),
                            CheckContext(run=run, pins=pins, mode=run.mode))
    finished = timezone.now()
    receipt = {"gate": gate, "check": step.args.get("check", ""), "args": check_args(step.args),
               "invariants": result.invariants, "details": result.details, "passed": result.passed, "pins": pins,
               "started_at": started, "finished_at": finished}
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=step.run_id)
        if run.status != Run.Status.RUNNING:  # paused or ended meanwhile: the gate runs again on resume
            return services.step_attempt_abandon(attempt_id=attempt.pk)
        if result.passed:
            outcome = services.step_attempt_succeed(attempt_id=attempt.pk, output=_receipt_output(receipt))
            if outcome.decision == "completed":
                _receipt_create(run, step, attempt, receipt)
            return outcome
        code = f"gate_failed:{gate}"
        message = gate_failure_message(gate, receipt["check"], result)
        outcome = services.step_attempt_fail(attempt_id=attempt.pk, code=code, message=message, retryable=False)
        if outcome.decision == "failed":
            _receipt_create(run, step, attempt, receipt)
            run.refresh_from_db()
            if run.status == Run.Status.RUNNING:  # a "continue" failure mode does not pass a failed gate
                services.run_fail(run_id=run.pk, code=code, message=message)
        return outcome


def gate_failure_message(gate: str, check: str, result: CheckResult) -> str:
    broken = ", ".join(result.broken)
    return f"gate {gate} ({check}): invariant {broken} broke; found {result.details}"


def _receipt_output(receipt: dict) -> dict:
    return {"gate": receipt["gate"], "check": receipt["check"], "passed": receipt["passed"],
            "invariants": receipt["invariants"], "details": receipt["details"]}


def _receipt_create(run: Run, step: Step, attempt: StepAttempt | None, receipt: dict,
                    kind: str = GateReceipt.Kind.GATE) -> GateReceipt:
    record = GateReceipt.objects.create(
        run=run, attempt_number=run.attempt_number, phase=phase_of_step(step), step=step, step_attempt=attempt,
        kind=kind, gate=receipt["gate"], check_name=receipt["check"], args=receipt["args"],
        invariants=receipt["invariants"], details=receipt["details"], passed=receipt["passed"], mode=run.mode,
        pins=receipt["pins"], started_at=receipt["started_at"], finished_at=receipt["finished_at"])
    if kind == GateReceipt.Kind.REVALIDATION:
        event_type = "gate_revalidated"
    else:
        event_type = "gate_passed" if record.passed else "gate_failed"
    event_record(type=event_type, organization_id=run.organization_id,
                 project_id=run.project_id, run_id=run.pk,
                 payload={"run": run.pk, "gate": record.gate, "check": record.check_name, "kind": record.kind,
                          "receipt": record.pk, "passed": record.passed, "invariants": record.invariants,
                          "phase": record.phase.name if record.phase else None})
    return record


def _drift_records(run: Run, drifts: list[Drift], *, before: str, kind: str = DriftRecord.Kind.PIN) -> list:
    now = timezone.now()
    records = [DriftRecord.objects.create(run=run, attempt_number=run.attempt_number, kind=kind,
                                          dimension=d.dimension, recorded=d.recorded, live=d.live,
                                          detected_before=before, detected_at=now) for d in drifts]
    event_record(type="run_drift_detected", organization_id=run.organization_id, project_id=run.project_id,
                 run_id=run.pk, payload={"run": run.pk, "before": before, "drift": [
                     {"dimension": d.dimension, "recorded": d.recorded, "live": d.live} for d in drifts]})
    return records


def _stop_on_drift(*, run_id: int, attempt: StepAttempt, drifts: list[Drift], before: str) -> services.StepOutcome:
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run_id)
        outcome = services.step_attempt_abandon(attempt_id=attempt.pk)
        if run.status == Run.Status.RUNNING:
            _drift_records(run, drifts, before=before)
            services.run_pause(run_id=run.pk, status_reason=f"{STOPPED_DRIFT}{drifts[0].dimension}"[:200],
                               reason=f"drift before gate {before}")
        return outcome


# --- sovereign gates ---------------------------------------------------------------------------

def _approval_execute(*, step: Step, attempt: StepAttempt) -> services.StepOutcome:
    gate = gate_name(step)
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=step.run_id)
        request = ApprovalRequest.objects.filter(run=run, attempt_number=run.attempt_number, gate=gate).first()
        if request is not None and request.status == ApprovalRequest.Status.APPROVED:
            return services.step_attempt_succeed(attempt_id=attempt.pk, output={
                "gate": gate, "approval_ref": request.approval_ref, "approved_by": request.approved_by_id,
                "approved_at": request.approved_at.isoformat()})
        if request is None:
            request = ApprovalRequest.objects.create(
                run=run, attempt_number=run.attempt_number, gate=gate, step=step,
                asked={"gate": gate, "step": step.name, "task": step.task.name,
                       "question": step.args.get("question", f"approve gate {gate!r} of run {run.pk}?"),
                       "pins": pins_values(run)})
            event_record(type="approval_requested", organization_id=run.organization_id, project_id=run.project_id,
                         run_id=run.pk, payload={"run": run.pk, "gate": gate, "approval": request.pk,
                                                 "asked": request.asked})
        outcome = services.step_attempt_abandon(attempt_id=attempt.pk)
        if run.status == Run.Status.RUNNING:
            services.run_pause(run_id=run.pk, status_reason=f"{AWAITING_APPROVAL}{gate}")
        return outcome


@transaction.atomic
def approval_grant(*, run_id: int, gate: str, approval_ref: str, actor=None, reason: str = "") -> ApprovalRequest:
    """Approve ``gate`` of a run waiting for it, with an approval reference used nowhere else."""
    errors = {}
    if not isinstance(gate, str) or not gate.strip():
        errors["gate"] = ["required"]
    if not isinstance(approval_ref, str) or not approval_ref.strip():
        errors["approval_ref"] = ["required"]
    if errors:
        raise ValidationFailed("invalid approval", errors=errors)
    try:
        run = Run.objects.select_for_update().get(pk=run_id)
    except (Run.DoesNotExist, ValueError, TypeError) as exc:
        raise NotFound(f"run {run_id} does not exist") from exc
    used = ApprovalRequest.objects.filter(approval_ref=approval_ref).first()
    if used is not None:
        if used.run_id == run.pk and used.gate == gate and used.attempt_number == run.attempt_number:
            return used  # the same approval again: nothing changes
        attempt = f" (attempt {used.attempt_number})" if used.run_id == run.pk else ""
        raise ApprovalReused(f"approval reference {approval_ref!r} was already used by run {used.run_id}{attempt} "
                             f"for gate {used.gate!r}; each approval needs a new reference",
                             run=used.run_id, gate=used.gate, attempt=used.attempt_number)
    request = ApprovalRequest.objects.filter(run=run, attempt_number=run.attempt_number, gate=gate,
                                             status=ApprovalRequest.Status.PENDING).first()
    if request is None or run.status_reason != f"{AWAITING_APPROVAL}{gate}":
        raise ApprovalNotPending(f"run {run.pk} is not waiting for an approval of gate {gate!r}"
                                 f" (status {run.status}{', ' + run.status_reason if run.status_reason else ''})",
                                 gate=gate)
    request.status = ApprovalRequest.Status.APPROVED
    request.approval_ref = approval_ref
    request.approved_by = actor if getattr(actor, "pk", None) else None
    request.approved_at = timezone.now()
    try:
        with transaction.atomic():
            request.save()
    except IntegrityError as exc:
        raise ApprovalReused(f"approval reference {approval_ref!r} was already used") from exc
    transition_log(entity="approval", id=request.pk, project=run.project_id, run=run.pk,
                   attempt=request.attempt_number, gate=gate, **{"from": ApprovalRequest.Status.PENDING,
                                                                 "to": request.status}, reason=reason)
    event_record(type="approval_granted", organization_id=run.organization_id, project_id=run.project_id,
                 run_id=run.pk, payload={"run": run.pk, "gate": gate, "approval": request.pk,
                                         "approval_ref": approval_ref})
    audit_record(actor=actor, action="approve_gate", target_type="run", target_id=run.pk,
                 organization_id=run.organization_id, run_id=run.pk, reason=reason,
                 before={"status_reason": run.status_reason}, after={"gate": gate, "approval_ref": approval_ref})
    if run.status != Run.Status.PAUSED:
        raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="approve")
    services.run_resume(run_id=run.pk, actor=actor, reason=reason or f"gate {gate} approved")
    return request


# --- drift ------------------------------------------------------------------------------------

@transaction.atomic
def drift_acknowledge(*, run_id: int, actor, reason: str, dimension: str | None = None) -> list[DriftRecord]:
    """Accept the run's open drift (every dimension, or ``dimension``) with a reason. A pin's live
    value is recorded as a new pin (actor, reason); the superseded pin stays in the run's record.
    The run stays paused: resuming it is a separate, audited step."""
    reason = (reason or "").strip()
    if not reason:
        raise ValidationFailed("a reason is required", errors={"reason": ["must not be empty"]})
    run = services._lock_run(run_id)
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
    event_record(type="run_drift_acknowledged", organization_id=run.organization_id, project_id=run.project_id,
                 run_id=run.pk, payload={"run": run.pk, "drift": summary, "reason": reason, "actor": label})
    audit_record(actor=actor, action="acknowledge_drift", target_type="run", target_id=run.pk,
                 organization_id=run.organization_id, run_id=run.pk, reason=reason,
                 before={"status_reason": run.status_reason, "drift": summary},
                 after={"pins": {d.dimension: d.live for d in drifts if d.kind == DriftRecord.Kind.PIN}})
    return drifts


# --- resume (seed 002 §7) ------------------------------------------------------------------

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


def _last_passed_gate(run: Run) -> GateReceipt | None:
    return (GateReceipt.objects.filter(run=run, attempt_number=run.attempt_number, kind=GateReceipt.Kind.GATE,
                                       passed=True).select_related("step").order_by("-finished_at", "-id").first())


def _revalidate(run: Run) -> Revalidation:
    found = Revalidation(drifts=pins_drift(run))
    if found.drifts:
        return found
    receipt = _last_passed_gate(run)
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
    if (peek.gated and peek.status == Run.Status.PAUSED and not peek.status_reason.startswith(AWAITING_APPROVAL)
            and not drift_open(peek).exists()):
        revalidation = _revalidate(peek)
    with transaction.atomic():
        run = services._lock_run(run_id)
        if run.status in (Run.Status.COMPLETED, Run.Status.RESUMING, Run.Status.RUNNING):
            return ResumeResult(run, "nothing", f"already {run.status}")
        if run.status == Run.Status.FAILED:
            raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="resume",
                                    why=f"it failed ({run.last_error_code}); retry it (a new attempt) or void it")
        if run.status != Run.Status.PAUSED:
            raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="resume")
        if run.status_reason.startswith(AWAITING_APPROVAL):
            waiting = run.status_reason[len(AWAITING_APPROVAL):]
            if not approval_ref:
                raise ApprovalRequired(f"run {run.pk} waits for an approval of gate {waiting!r}: resume it with "
                                       f"the gate and an approval reference", gate=waiting)
            approval_grant(run_id=run.pk, gate=gate or waiting, approval_ref=approval_ref, actor=actor,
                           reason=reason)
            return ResumeResult(services._lock_run(run_id), "approved", f"gate {gate or waiting!r} approved")
        if not run.gated:
            return ResumeResult(services.run_resume(run_id=run.pk, actor=actor, reason=reason), "resumed")
        drift_refuse_unacknowledged(run)
        if revalidation is None:  # its state changed since we looked: look again next time
            raise Conflict(f"run {run.pk} changed while it was being checked; resume it again",
                           code="run_busy")
        stopped = _apply_revalidation(run, revalidation)
        if stopped:
            return ResumeResult(run, "stopped_drift", run.status_reason, drift=stopped)
        audit_after = {"revalidated_gate": revalidation.receipt.gate if revalidation.receipt else None}
        run = services.run_resume(run_id=run.pk, actor=actor, reason=reason)
        return ResumeResult(run, "resumed", ", ".join(f"{k}: {v}" for k, v in audit_after.items() if v))


def recovery_revalidate(*, run_id: int, attempt: StepAttempt) -> services.StepOutcome | None:
    """A step attempt replayed after its worker died (the run was "mid-phase" on disk, seed 002 §7):
    check the pins and the last passed gate again before going on. None: go on with the replay;
    otherwise the run stopped as ``stopped_drift`` and the attempt was dropped (it runs again on resume)."""
    run = Run.objects.get(pk=run_id)
    if not run.gated:
        return None
    found = _revalidate(run)
    with transaction.atomic():
        run = services._lock_run(run_id)
        if run.status != Run.Status.RUNNING:
            return None  # it moved on meanwhile: the replay finds out by itself
        if not found.drifts and (found.result is None or found.result.passed):
            _apply_revalidation(run, found, before="recovery")  # the re-check's receipt
            return None
        outcome = services.step_attempt_abandon(attempt_id=attempt.pk)
        dimension = found.drifts[0].dimension if found.drifts else f"{GATE_DIMENSION}{found.receipt.gate}"
        run = services.run_pause(run_id=run.pk, status_reason=f"{STOPPED_DRIFT}{dimension}"[:200],
                                 reason="drift found when recovering an interrupted step")
        _apply_revalidation(run, found, before="recovery")
        return outcome


def _apply_revalidation(run: Run, revalidation: Revalidation, *, before: str = "resume") -> list[dict]:
    """Record what the re-check found; stop the run (its reason) on drift. Returns the drift found."""
    if revalidation.drifts:
        _drift_records(run, revalidation.drifts, before=before)
        _stop_reason(run, f"{STOPPED_DRIFT}{revalidation.drifts[0].dimension}")
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
    _stop_reason(run, f"{STOPPED_DRIFT}{drift.dimension}")
    return [{"dimension": drift.dimension, "recorded": drift.recorded, "live": drift.live}]


def _stop_reason(run: Run, reason: str) -> None:
    before = run.status_reason
    if before == reason[:200]:
        return
    run.status_reason = reason[:200]
    run.save(update_fields=["status_reason", "updated_at"])
    event_record(type="run_stopped", organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                 payload={"run": run.pk, "status": run.status, "from": before, "status_reason": run.status_reason})
