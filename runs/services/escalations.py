"""Escalation tickets (seed 001 §6.2): open on the triggers, then acknowledged and resolved.

One incident per run: a run has at most one unresolved ticket (a unique constraint). A trigger that
fires while that ticket is open or acknowledged is added to it (``escalation_add_detail``: the
ticket's ``triggers`` list and detail gain an entry, an ``escalation_updated`` event is written),
never a second ticket.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone
from django_fsm import can_proceed

from core.errors import InvalidTransition, ValidationFailed
from core.services import audit_record, row_lock, transition_log
from runs.events import ESCALATION_UPDATED, escalation_event
from runs.models import OPEN_ESCALATION_STATES, EscalationTicket, Run, StepAttempt
from runs.outbox import run_atomic, run_event_record

ERROR_WINDOW = timedelta(minutes=5)
ERROR_THRESHOLD = 5  # more than this many errors in the window
ERROR_RATE_THRESHOLD = 0.5  # above this share of failed attempts in the window
ERROR_RATE_MIN_SAMPLE = 4


def _emit(ticket: EscalationTicket, *, before: str) -> None:
    run = ticket.run
    run_event_record(type=escalation_event(ticket.status), organization_id=ticket.organization_id,
                     project_id=run.project_id, run_id=run.pk,
                     payload={"escalation": ticket.pk, "run": run.pk, "trigger": ticket.trigger, "from": before,
                              "to": ticket.status, "severity": ticket.severity, "detail": ticket.detail})
    transition_log(entity="escalation", id=ticket.pk, run=run.pk, project=run.project_id,
                   **{"from": before, "to": ticket.status}, reason=ticket.trigger)


def _trigger_entry(trigger: str, detail: str, at=None) -> dict:
    return {"trigger": trigger, "at": (at or timezone.now()).isoformat(), "detail": detail}


def _unresolved(run: Run) -> EscalationTicket | None:
    return EscalationTicket.objects.filter(run=run, status__in=OPEN_ESCALATION_STATES).first()


@run_atomic()
def escalation_open(*, run: Run, trigger: str, detail: str, actor=None, reason: str = "",
                    severity: str = "high") -> tuple[EscalationTicket, bool]:
    """Open the run's ticket for ``trigger``; while the run already has an open or acknowledged
    ticket, the trigger is added to that one instead (``created`` is then False)."""
    if trigger not in EscalationTicket.Trigger.values:
        raise ValidationFailed("unknown trigger", errors={"trigger": [f"{trigger!r} is not a trigger"]})
    existing = _unresolved(run)
    if existing is None:
        try:
            with transaction.atomic():
                ticket = EscalationTicket.objects.create(
                    run=run, organization_id=run.organization_id, trigger=trigger, detail=detail, severity=severity,
                    triggers=[_trigger_entry(trigger, detail)])
        except IntegrityError:  # opened meanwhile by a concurrent trigger: add to that one
            existing = EscalationTicket.objects.get(run=run, status__in=OPEN_ESCALATION_STATES)
    if existing is not None:
        ticket = escalation_add_detail(ticket=existing, detail=detail, trigger=trigger)
    else:
        _emit(ticket, before="")
    if actor is not None:
        audit_record(actor=actor, action="run_escalate", target_type="run", target_id=run.pk,
                     organization_id=run.organization_id, run_id=run.pk, reason=reason or detail,
                     after={"escalation": ticket.pk, "trigger": trigger, "added": existing is not None})
    return ticket, existing is None


@run_atomic()
def escalation_add_detail(*, ticket: EscalationTicket, detail: str, trigger: str | None = None) -> EscalationTicket:
    """A trigger fired while the ticket is still unresolved: the ticket gains an entry in ``triggers``
    and a line in its detail (and an ``escalation_updated`` event) instead of a second ticket, so
    nothing that happened is lost. ``trigger`` defaults to the ticket's opening trigger."""
    ticket = EscalationTicket.objects.select_for_update().select_related("run").get(pk=ticket.pk)
    trigger = trigger or ticket.trigger
    now = timezone.now()
    ticket.detail = f"{ticket.detail}\n{now:%Y-%m-%d %H:%M:%S} {trigger}: {detail}"
    ticket.triggers = [*ticket.triggers, _trigger_entry(trigger, detail, now)]
    ticket.save(update_fields=["detail", "triggers"])
    run = ticket.run
    run_event_record(type=ESCALATION_UPDATED, organization_id=ticket.organization_id, project_id=run.project_id,
                     run_id=run.pk, payload={"escalation": ticket.pk, "run": run.pk, "trigger": trigger,
                                             "status": ticket.status, "added": detail, "severity": ticket.severity})
    return ticket


def _ticket_moved(ticket: EscalationTicket, *, before: str, actor, action: str, reason: str) -> EscalationTicket:
    """Save a ticket an operator moved on, with its event and its audit row (in the caller's transaction)."""
    ticket.save()
    _emit(ticket, before=before)
    audit_record(actor=actor, action=action, target_type="escalation", target_id=ticket.pk,
                 organization_id=ticket.organization_id, run_id=ticket.run_id, reason=reason,
                 before={"status": before}, after={"status": ticket.status})
    return ticket


@run_atomic()
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
    return _ticket_moved(ticket, before=before, actor=actor, action="escalation_acknowledge", reason=reason)


@run_atomic()
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
    return _ticket_moved(ticket, before=before, actor=actor, action="escalation_resolve", reason=reason)


def escalations_evaluate(*, run: Run, failed_attempt: StepAttempt, uncapped_delay_ms: int | None,
                         retries_exhausted: bool, cap_ms: int) -> list[EscalationTicket]:
    """Open (or add to) the run's ticket for the triggers seed 001 §6.2 calls for after a failed step
    attempt. A trigger already on the run's unresolved ticket is not added again on every failed
    attempt. Returns the tickets opened."""
    opened = []
    current = _unresolved(run)
    gathered = {entry.get("trigger") for entry in current.triggers} if current is not None else set()
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
        if fired and trigger not in gathered:
            gathered.add(trigger)
            ticket, created = escalation_open(run=run, trigger=trigger, detail=detail)
            if created:
                opened.append(ticket)
    return opened
