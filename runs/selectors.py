"""Reads of runs for operators: stuck runs, escalated runs, per-run timelines.

The thresholds are the run timeouts of DESIGN §2.1 (``ORCHESTRATOR_RUN_*_TIMEOUT_S``), read
when called, so the admin filter, the recovery runbook and the reaper agree on "stuck".
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from jobs.models import Job, JobState
from runs.models import EscalationTicket, Run


def _work_waiting_in_queue() -> Exists:
    """The run has a job waiting for a worker: silence is the queue's, not a lost worker's."""
    return Exists(Job.objects.filter(run_id=OuterRef("pk"), state__in=[JobState.RECEIVED, JobState.QUEUED,
                                                                          JobState.AWAITING_TOOL]))


def run_heartbeat_stale_q(*, older_than_s: int | None = None, now=None) -> Q:
    """Running, and no worker heartbeat for ``older_than_s`` (default: the heartbeat timeout)."""
    now = now or timezone.now()
    seconds = settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S if older_than_s is None else older_than_s
    cutoff = now - timedelta(seconds=seconds)
    silent = Q(last_heartbeat__lt=cutoff) | Q(last_heartbeat__isnull=True, status_changed_at__lt=cutoff)
    return Q(status=Run.Status.RUNNING) & silent & ~Q(_work_waiting_in_queue())


def runs_heartbeat_stale(*, older_than_s: int | None = None, now=None) -> QuerySet:
    """Runs for the stuck-run runbook (seed 001 §9.1): running with a silent worker."""
    return Run.objects.filter(run_heartbeat_stale_q(older_than_s=older_than_s, now=now)).order_by("id")


def run_stuck_q(*, now=None) -> Q:
    """A silent running run, or a run in pending, running, paused, resuming or retrying for longer
    than that state's timeout."""
    now = now or timezone.now()

    def before(seconds: int):
        return now - timedelta(seconds=seconds)

    too_long = (
        Q(status=Run.Status.PENDING, status_changed_at__lt=before(settings.ORCHESTRATOR_RUN_PENDING_TIMEOUT_S))
        | Q(status=Run.Status.RUNNING, started_at__lt=before(settings.ORCHESTRATOR_RUN_RUNNING_TIMEOUT_S))
        | Q(status=Run.Status.PAUSED, status_changed_at__lt=before(settings.ORCHESTRATOR_RUN_PAUSED_TIMEOUT_S))
        | Q(status=Run.Status.RESUMING, status_changed_at__lt=before(settings.ORCHESTRATOR_RUN_RESUMING_TIMEOUT_S))
        | Q(status=Run.Status.RETRYING, status_changed_at__lt=before(settings.ORCHESTRATOR_RUN_RETRYING_TIMEOUT_S))
    )
    return run_heartbeat_stale_q(now=now) | too_long


def run_escalated() -> Exists:
    """An annotation/filter: the run has an escalation ticket that is not resolved."""
    return Exists(EscalationTicket.objects.filter(run_id=OuterRef("pk")).exclude(
        status=EscalationTicket.Status.RESOLVED))


def run_open_escalation(*, run: Run, trigger: str) -> EscalationTicket | None:
    return (EscalationTicket.objects.filter(run=run, trigger=trigger)
            .exclude(status=EscalationTicket.Status.RESOLVED).first())


def run_held_credits(run: Run) -> int:
    """Credits reserved for the run and neither charged nor released yet."""
    return run.credits_reserved - run.credits_charged - run.credits_refunded
