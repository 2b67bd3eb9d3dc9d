"""Escalation tickets (seed 001 §6.2): open on the triggers, then acknowledged and resolved.

A run has at most one unresolved ticket per trigger (a unique constraint): a trigger that fires
again while its ticket is open opens no second ticket; callers with something new to say add it
to the open one (``escalation_add_detail``).
"""

from __future__ import annotations

from datetime import timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone
from django_fsm import can_proceed

from core.errors import InvalidTransition, ValidationFailed
from core.services import audit_record, event_record, row_lock, transition_log
from runs.events import ESCALATION_UPDATED, escalation_event
from runs.models import EscalationTicket, Run, StepAttempt

ERROR_WINDOW = timedelta(minutes=5)
ERROR_THRESHOLD = 5  # more than this many errors in the window
ERROR_RATE_THRESHOLD = 0.5  # above this share of failed attempts in the window
ERROR_RATE_MIN_SAMPLE = 4


def _emit(ticket: EscalationTicket, *, before: str) -> None:
    run = ticket.run
    event_record(type=escalation_event(ticket.status), organization_id=ticket.organization_id,
                 project_id=run.project_id, run_id=run.pk,
                 payload={"escalation": ticket.pk, "run": run.pk, "trigger": ticket.trigger, "from": before,
                          "to": ticket.status, "severity": ticket.severity, "detail": ticket.detail})
    transition_log(entity="escalation", id=ticket.pk, run=run.pk, project=run.project_id,
                   **{"from": before, "to": ticket.status}, reason=ticket.trigger)


def escalation_open(*, run: Run, trigger: str, detail: str, actor=None, reason: str = "",
                    severity: str = "high") -> tuple[EscalationTicket, bool]:
    """Open a ticket for ``run`` (or return its unresolved ticket for the same trigger)."""
    if trigger not in EscalationTicket.Trigger.values:
        raise ValidationFailed("unknown trigger", errors={"trigger": [f"{trigger!r} is not a trigger"]})
    existing = EscalationTicket.objects.filter(run=run, trigger=trigger).exclude(
        status=EscalationTicket.Status.RESOLVED).first()
    if existing is not None:
        return existing, False
    try:
        with transaction.atomic():
            ticket = EscalationTicket.objects.create(run=run, organization_id=run.organization_id, trigger=trigger,
                                                     detail=detail, severity=severity)
    except IntegrityError:
        return EscalationTicket.objects.get(run=run, trigger=trigger,
                                            status__in=["open", "acknowledged"]), False
    _emit(ticket, before="")
    if actor is not None:
        audit_record(actor=actor, action="run_escalate", target_type="run", target_id=run.pk,
                     organization_id=run.organization_id, run_id=run.pk, reason=reason or detail,
                     after={"escalation": ticket.pk, "trigger": trigger})
    return ticket, True


def escalation_add_detail(*, ticket: EscalationTicket, detail: str) -> EscalationTicket:
    """The trigger fired again while its ticket is still unresolved: the ticket gains a line (and
    an ``escalation_updated`` event) instead of a second ticket, so nothing that happened is lost."""
    ticket = EscalationTicket.objects.select_for_update().select_related("run").get(pk=ticket.pk)
    stamp = timezone.now().strftime("%Y-%m-%d %H:%M:%S")
    ticket.detail = f"{ticket.detail}\n{stamp} again: {detail}"
    ticket.save(update_fields=["detail"])
    run = ticket.run
    event_record(type=ESCALATION_UPDATED, organization_id=ticket.organization_id, project_id=run.project_id,
                 run_id=run.pk, payload={"escalation": ticket.pk, "run": run.pk, "trigger": ticket.trigger,
                                         "status": ticket.status, "added": detail, "severity": ticket.severity})
    return ticket


@transaction.atomic
def escalation_acknowledge(*, ticket_id: int, actor, reason: str = "") -> EscalationTicket:
    """open → acknowledged. Already acknowledged: no-op."""
    ticket = row_lock(EscalationTicket, ticket_id, entity="escalation", related=("run",))
    if ticket.status == EscalationTicket.Status.ACKNOWLEDGED:
        return ticket
    if not can_proceed(ticket.acknowledge):
        raise InvalidTransition(entity="escalation", entity_id=ticket.pk, current=ticket.status,
                                requested="acknowledge")
    before = ticket.status
    ticket.acknowledge()
    ticket.acknowledged_at = timezone.now()
    ticket.acknowledged_by = actor if getattr(actor, "pk", None) else None
    ticket.save()
    _emit(ticket, before=before)
    audit_record(actor=actor, action="escalation_acknowledge", target_type="escalation", target_id=ticket.pk,
                 organization_id=ticket.organization_id, run_id=ticket.run_id, reason=reason,
                 before={"status": before}, after={"status": ticket.status})
    return ticket


@transaction.atomic
def escalation_resolve(*, ticket_id: int, actor, reason: str) -> EscalationTicket:
    """open|acknowledged → resolved with a resolution note. Already resolved: no-op."""
    if not (reason or "").strip():
        raise ValidationFailed("a resolution is required", errors={"reason": ["must not be empty"]})
    ticket = row_lock(EscalationTicket, ticket_id, entity="escalation", related=("run",))
    if ticket.status == EscalationTicket.Status.RESOLVED:
        return ticket
    before = ticket.status
    ticket.resolve()
    ticket.resolved_at = timezone.now()
    ticket.resolved_by = actor if getattr(actor, "pk", None) else None
    ticket.resolution = reason
    ticket.save()
    _emit(ticket, before=before)
    audit_record(actor=actor, action="escalation_resolve", target_type="escalation", target_id=ticket.pk,
                 organization_id=ticket.organization_id, run_id=ticket.run_id, reason=reason,
                 before={"status": before}, after={"status": ticket.status})
    return ticket


def escalations_evaluate(*, run: Run, failed_attempt: StepAttempt, uncapped_delay_ms: int | None,
                         retries_exhausted: bool, cap_ms: int) -> list[EscalationTicket]:
    """Open the tickets seed 001 §6.2's triggers call for after a failed step attempt."""
    opened = []
    since = timezone.now() - ERROR_WINDOW
    recent = StepAttempt.objects.filter(run=run, started_at__gte=since).exclude(
        outcome__in=[StepAttempt.Outcome.RUNNING, StepAttempt.Outcome.DISCARDED])
    errors = recent.filter(outcome=StepAttempt.Outcome.FAILED).count()
    total = recent.count()
    checks = [
        (errors > ERROR_THRESHOLD, EscalationTicket.Trigger.ERROR_BURST,
         f"{errors} step errors in the last 5 minutes (threshold {ERROR_THRESHOLD})"),
        (total >= ERROR_RATE_MIN_SAMPLE and errors / total > ERROR_RATE_THRESHOLD, EscalationTicket.Trigger.ERROR_RATE,
         f"error rate {errors}/{total} = {errors / total:.0%} in the last 5 minutes" if total else ""),
        (uncapped_delay_ms is not None and uncapped_delay_ms > cap_ms, EscalationTicket.Trigger.BACKOFF_CAP,
         f"backoff {uncapped_delay_ms} ms would pass its {cap_ms} ms cap"),
        (retries_exhausted, EscalationTicket.Trigger.RETRIES_EXHAUSTED,
         f"retryable error {failed_attempt.error_code} exhausted the step's tries: {failed_attempt.error}"),
    ]
    for fired, trigger, detail in checks:
        if fired:
            ticket, created = escalation_open(run=run, trigger=trigger, detail=detail)
            if created:
                opened.append(ticket)
    return opened
