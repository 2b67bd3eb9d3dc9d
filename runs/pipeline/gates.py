"""Gate steps of gated pipelines (DESIGN §4, seed 002 §2–§5), run by the execution engine.

* ``check`` steps (internal gates): the run's pins are recomputed first (any difference stops
  the run as ``stopped_drift:<dimension>``); then the named check judges its invariants. A pass
  records a ``GateReceipt`` on the phase, in the same transaction as the step's success; a
  failure records the receipt and fails the run with ``gate_failed:<gate>`` and the broken
  invariant, whatever the failure modes say (gates fail closed).
* ``approval`` steps (sovereign gates): an ``ApprovalRequest`` (what is asked, the pins then) and
  the run pauses as ``awaiting_approval:<gate>`` until ``runs.services.approval_grant``.
"""


from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from runs import services
from runs.events import APPROVAL_REQUESTED
from runs.models import (
    ApprovalRequest,
    Run,
    Step,
    StepAttempt,
)
from runs.outbox import run_event_record
from runs.pipeline.bookkeeping import _drift_records, _receipt_create, _receipt_output
from runs.pipeline.checks import CheckContext, CheckResult, check_args, check_evaluate
from runs.pipeline.pins import Drift, pins_drift, pins_values
from runs.substates import SubState, status_reason


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


def _stop_on_drift(*, run_id: int, attempt: StepAttempt, drifts: list[Drift], before: str) -> services.StepOutcome:
    with transaction.atomic():
        run = Run.objects.select_for_update().get(pk=run_id)
        outcome = services.step_attempt_abandon(attempt_id=attempt.pk)
        if run.status == Run.Status.RUNNING:
            _drift_records(run, drifts, before=before)
            services.run_pause(run_id=run.pk, status_reason=status_reason(SubState.STOPPED_DRIFT, drifts[0].dimension),
                               reason=f"drift before gate {before}")
        return outcome


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
            run_event_record(type=APPROVAL_REQUESTED, organization_id=run.organization_id, project_id=run.project_id,
                             run_id=run.pk, payload={"run": run.pk, "gate": gate, "approval": request.pk,
                                                     "asked": request.asked})
        outcome = services.step_attempt_abandon(attempt_id=attempt.pk)
        if run.status == Run.Status.RUNNING:
            services.run_pause(run_id=run.pk, status_reason=status_reason(SubState.AWAITING_APPROVAL, gate))
        return outcome

