"""Time caps of gated pipelines (seed 002 §6): a soft cap per phase, a hard cap per run.

Caps count running time only (the attempt's running clock, see ``runs.pipeline``): waiting for
an approval or an operator does not use them up. Passing one stops the run — it pauses as
``stop_and_escalate:<cap>`` (``soft_cap:<phase>`` or ``hard_cap``) — and opens an escalation
ticket (trigger ``stop_and_escalate``) for a human to look at the partial run. Each cap fires
once per phase (or attempt): an operator who resumes the run lets it go on past that cap.

``caps_enforce`` runs after every step of a gated run and in the workers' maintenance pass
(``runs_caps_enforce``), so a step that overruns is stopped while it runs.
"""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from core.services import event_record
from runs import services
from runs.escalations import escalation_add_detail, escalation_open
from runs.models import EscalationTicket, PhaseRecord, Run, RunAttempt
from runs.pipeline import attempt_active_ms, run_hard_cap_minutes

STOP_AND_ESCALATE = "stop_and_escalate:"


def _minutes(ms: int) -> str:
    return f"{ms / 60000:.2f} min"


def _cap_due(run: Run, attempt: RunAttempt | None, now) -> tuple[str, str, PhaseRecord | None] | None:
    """The first cap the run's current attempt is past and has not escalated: (cap, detail, phase)."""
    active = attempt_active_ms(attempt, now)
    hard_minutes = run_hard_cap_minutes(run)
    if attempt is not None and attempt.hard_cap_escalated_at is None and active > hard_minutes * 60_000:
        return "hard_cap", f"run {run.pk} ran {_minutes(active)}, past its hard cap of {hard_minutes:g} min", None
    phases = PhaseRecord.objects.filter(run=run, attempt_number=run.attempt_number, cap_escalated_at__isnull=True,
                                        soft_cap_minutes__isnull=False)
    for phase in phases.order_by("started_at", "id"):
        end = phase.active_ms_at_end if phase.active_ms_at_end is not None else active
        used = end - phase.active_ms_at_start
        if used > phase.soft_cap_minutes * 60_000:
            return (f"soft_cap:{phase.name}", f"phase {phase.name} of run {run.pk} ran {_minutes(used)}, past its "
                                              f"soft cap of {phase.soft_cap_minutes:g} min", phase)
    return None


def caps_enforce(*, run_id: int, now=None) -> str | None:
    """Stop a running gated run past a cap; returns the cap (``hard_cap``, ``soft_cap:<phase>``) or None.
    Reads first without a lock (the maintenance pass looks at every running gated run)."""
    now = now or timezone.now()
    run = Run.objects.filter(pk=run_id, status=Run.Status.RUNNING, gated=True).first()
    if run is None or _cap_due(run, RunAttempt.objects.filter(run=run, number=run.attempt_number).first(),
                               now) is None:
        return None
    with transaction.atomic():
        run = services._lock_run(run_id)
        if run.status != Run.Status.RUNNING or not run.gated:
            return None
        attempt = RunAttempt.objects.filter(run=run, number=run.attempt_number).first()
        due = _cap_due(run, attempt, now)
        if due is None:
            return None
        cap, detail, phase = due
        if phase is None:
            attempt.hard_cap_escalated_at = now
            attempt.save(update_fields=["hard_cap_escalated_at"])
        else:
            phase.cap_escalated_at = now
            phase.save(update_fields=["cap_escalated_at"])
        event_record(type="run_cap_exceeded", organization_id=run.organization_id, project_id=run.project_id,
                     run_id=run.pk, payload={"run": run.pk, "cap": cap, "detail": detail,
                                             "active_ms": attempt_active_ms(attempt, now)})
        run = services.run_pause(run_id=run.pk, status_reason=f"{STOP_AND_ESCALATE}{cap}"[:200], reason=detail)
        ticket, created = escalation_open(run=run, trigger=EscalationTicket.Trigger.CAP, detail=detail)
        if not created:  # an earlier cap's ticket is still open: this cap goes on it
            escalation_add_detail(ticket=ticket, detail=detail)
        return cap


def runs_caps_enforce(*, now=None) -> int:
    """One maintenance pass over running gated runs; returns how many were stopped."""
    stopped = 0
    for run_id in Run.objects.filter(status=Run.Status.RUNNING, gated=True).values_list("pk", flat=True):
        stopped += caps_enforce(run_id=run_id, now=now) is not None
    return stopped
