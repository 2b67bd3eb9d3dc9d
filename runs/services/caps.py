"""Stopping gated runs past a time cap (seed 002 §6): the run pauses as ``stop_and_escalate:<cap>``
and an escalation ticket opens (or gathers the cap, when one is open already).

``caps_enforce`` runs after every step of a gated run and in the workers' maintenance pass
(``runs_caps_enforce``), so a step that overruns is stopped while it runs.
"""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from runs.events import RUN_CAP_EXCEEDED
from runs.models import EscalationTicket, Run, RunAttempt
from runs.outbox import run_event_record
from runs.pipeline.bookkeeping import attempt_active_ms
from runs.pipeline.caps import cap_due
from runs.services.common import _lock_run
from runs.services.escalations import escalation_open
from runs.services.lifecycle import run_pause
from runs.substates import SubState, status_reason


def caps_enforce(*, run_id: int, now=None) -> str | None:
    """Stop a running gated run past a cap; returns the cap (``hard_cap``, ``soft_cap:<phase>``) or None.
    Reads first without a lock (the maintenance pass looks at every running gated run)."""
    now = now or timezone.now()
    run = Run.objects.filter(pk=run_id, status=Run.Status.RUNNING, gated=True).first()
    if run is None or cap_due(run, RunAttempt.objects.filter(run=run, number=run.attempt_number).first(),
                               now) is None:
        return None
    with transaction.atomic():
        run = _lock_run(run_id)
        if run.status != Run.Status.RUNNING or not run.gated:
            return None
        attempt = RunAttempt.objects.filter(run=run, number=run.attempt_number).first()
        due = cap_due(run, attempt, now)
        if due is None:
            return None
        cap, detail, phase = due
        if phase is None:
            attempt.hard_cap_escalated_at = now
            attempt.save(update_fields=["hard_cap_escalated_at"])
        else:
            phase.cap_escalated_at = now
            phase.save(update_fields=["cap_escalated_at"])
        run_event_record(type=RUN_CAP_EXCEEDED, organization_id=run.organization_id, project_id=run.project_id,
                         run_id=run.pk, payload={"run": run.pk, "cap": cap, "detail": detail,
                                                 "active_ms": attempt_active_ms(attempt, now)})
        run = run_pause(run_id=run.pk, status_reason=status_reason(SubState.STOP_AND_ESCALATE, cap), reason=detail)
        # an earlier cap's (or any trigger's) ticket is still open: this cap goes on it
        escalation_open(run=run, trigger=EscalationTicket.Trigger.CAP, detail=detail)
        return cap


def runs_caps_enforce(*, now=None) -> int:
    """One maintenance pass over running gated runs; returns how many were stopped."""
    stopped = 0
    for run_id in Run.objects.filter(status=Run.Status.RUNNING, gated=True).values_list("pk", flat=True):
        stopped += caps_enforce(run_id=run_id, now=now) is not None
    return stopped
