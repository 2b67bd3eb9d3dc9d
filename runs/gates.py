"""Gate steps: ``approval`` (sovereign gates) pause the run until a human approves.

An approval step records an ``ApprovalRequest`` and pauses the run with the reason
``awaiting_approval:<gate>``; ``approval_grant`` validates the approval (the gate is pending
for this run, the reference was never used by any run or gate), records it and resumes the
run; the step then passes. Approving twice with the same input changes nothing.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.utils import timezone

from core.errors import Conflict, InvalidTransition, NotFound, ValidationFailed
from core.services import audit_record, event_record
from runs import services
from runs.models import ApprovalRequest, Run, Step, StepAttempt


class ApprovalReused(Conflict):
    code = "approval_reused"


class ApprovalNotPending(Conflict):
    code = "approval_not_pending"


def gate_execute(*, step: Step, attempt: StepAttempt) -> services.StepOutcome:
    """Execute a gate step's attempt (called by the ``run_step`` job)."""
    if step.kind == Step.Kind.APPROVAL:
        return _approval_execute(step=step, attempt=attempt)
    return services.step_attempt_fail(attempt_id=attempt.pk, code="unknown_gate_kind",
                                      message=f"step kind {step.kind!r} cannot run here", retryable=False)


def _approval_execute(*, step: Step, attempt: StepAttempt) -> services.StepOutcome:
    gate = step.args.get("gate") or step.name
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
                       "pins": (run.plan or {}).get("pins_recorded", {})})
            event_record(type="approval_requested", organization_id=run.organization_id, project_id=run.project_id,
                         run_id=run.pk, payload={"run": run.pk, "gate": gate, "approval": request.pk,
                                                 "asked": request.asked})
        outcome = services.step_attempt_abandon(attempt_id=attempt.pk)
        if run.status == Run.Status.RUNNING:
            services.run_pause(run_id=run.pk, status_reason=f"awaiting_approval:{gate}")
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
        if used.run_id == run.pk and used.gate == gate:
            return used  # the same approval again: nothing changes
        raise ApprovalReused(f"approval reference {approval_ref!r} was already used by run {used.run_id} "
                             f"for gate {used.gate!r}", run=used.run_id, gate=used.gate)
    request = ApprovalRequest.objects.filter(run=run, attempt_number=run.attempt_number, gate=gate,
                                             status=ApprovalRequest.Status.PENDING).first()
    if request is None or run.status_reason != f"awaiting_approval:{gate}":
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
