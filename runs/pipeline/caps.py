"""Time caps of gated pipelines (seed 002 §6): a soft cap per phase, a hard cap per run.

Caps count running time only (the attempt's running clock, see ``runs.pipeline``): waiting for
an approval or an operator does not use them up. Passing one stops the run — it pauses as
``stop_and_escalate:<cap>`` (``soft_cap:<phase>`` or ``hard_cap``) — and opens an escalation
ticket (trigger ``stop_and_escalate``) for a human to look at the partial run. Each cap fires
once per phase (or attempt): an operator who resumes the run lets it go on past that cap.

This module says which cap is due (``cap_due``); ``runs.services.caps`` stops the run.
"""

from __future__ import annotations


from runs.models import PhaseRecord, Run, RunAttempt
from runs.pipeline.bookkeeping import attempt_active_ms, run_hard_cap_minutes


def _minutes(ms: int) -> str:
    return f"{ms / 60000:.2f} min"


def cap_due(run: Run, attempt: RunAttempt | None, now) -> tuple[str, str, PhaseRecord | None] | None:
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
