"""Approvals of sovereign gates: ``approval_grant`` validates an approval (the gate is pending for
this run and attempt, the reference was never used by any run, gate or attempt) and resumes the run.
"""


from __future__ import annotations

from django.db import IntegrityError, transaction
from django.utils import timezone

from core.errors import InvalidTransition, ValidationFailed
from core.services import audit_record, transition_log
from runs.errors import ApprovalNotPending, ApprovalReused
from runs.events import APPROVAL_GRANTED
from runs.models import (
    ApprovalRequest,
    Run,
)
from runs.outbox import run_atomic, run_event_record
from runs.services.common import _lock_run
from runs.services.lifecycle import run_resume
from runs.substates import StatusReason, SubState


@run_atomic()
def approval_grant(*, run_id: int, gate: str, approval_ref: str, actor=None, reason: str = "") -> ApprovalRequest:
    """Approve ``gate`` of a run waiting for it, with an approval reference used nowhere else."""
    errors = {}
    if not isinstance(gate, str) or not gate.strip():
        errors["gate"] = ["required"]
    if not isinstance(approval_ref, str) or not approval_ref.strip():
        errors["approval_ref"] = ["required"]
    if errors:
        raise ValidationFailed("invalid approval", errors=errors)
    run = _lock_run(run_id)
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
    if request is None or not StatusReason.parse(run.status_reason).is_(SubState.AWAITING_APPROVAL, gate):
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
    run_event_record(type=APPROVAL_GRANTED, organization_id=run.organization_id, project_id=run.project_id,
                     run_id=run.pk, payload={"run": run.pk, "gate": gate, "approval": request.pk,
                                             "approval_ref": approval_ref})
    audit_record(actor=actor, action="approve_gate", target_type="run", target_id=run.pk,
                 organization_id=run.organization_id, run_id=run.pk, reason=reason,
                 before={"status_reason": run.status_reason}, after={"gate": gate, "approval_ref": approval_ref})
    if run.status != Run.Status.PAUSED:
        raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="approve")
    run_resume(run_id=run.pk, actor=actor, reason=reason or f"gate {gate} approved")
    return request

