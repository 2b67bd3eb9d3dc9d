"""The run reaper (DESIGN §2.1 timeouts), run by the workers' shared maintenance.

Gated runs past a time cap (seed 002 §6) stop and escalate. Pending, running, resuming and
retrying runs past their timeout fail; a running run whose
worker stopped sending heartbeats fails with ``heartbeat_timeout`` (unless its work is only
waiting in the queue); paused runs past theirs are cancelled. Every path goes through the run
services, so the unused reservation is refunded. Active runs with no job at all (a lost
message, a crash between commit and enqueue) are handed to a worker again. With
``ORCHESTRATOR_RUN_AUTO_RECOVER`` off, those last two are left to the recovery runbook.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from core.errors import DomainError
from jobs.models import ACTIVE_JOB_STATES, Job, JobState
from runs import services
from runs.models import ACTIVE_RUN_STATES, IN_FLIGHT_RUN_STATES, Run

logger = logging.getLogger("orchestrator.runs")

ORPHAN_GRACE = timedelta(seconds=5)


def _timeouts() -> list[tuple[str, int, str, str]]:
    return [
        (Run.Status.PENDING, settings.ORCHESTRATOR_RUN_PENDING_TIMEOUT_S, "fail", "pending_timeout"),
        (Run.Status.RUNNING, settings.ORCHESTRATOR_RUN_RUNNING_TIMEOUT_S, "fail", "running_timeout"),
        (Run.Status.RESUMING, settings.ORCHESTRATOR_RUN_RESUMING_TIMEOUT_S, "fail", "resuming_timeout"),
        (Run.Status.RETRYING, settings.ORCHESTRATOR_RUN_RETRYING_TIMEOUT_S, "fail", "retrying_timeout"),
        (Run.Status.PAUSED, settings.ORCHESTRATOR_RUN_PAUSED_TIMEOUT_S, "cancel", "paused_timeout"),
    ]


def _end(run_id: int, action: str, code: str, message: str) -> bool:
    try:
        if action == "fail":
            services.run_fail(run_id=run_id, code=code, message=message)
        else:
            services.run_cancel(run_id=run_id, code=code, reason=message)
        return True
    except DomainError as exc:  # it moved on meanwhile
        logger.info("reaper left run %s alone: %s", run_id, exc)
        return False


def runs_reap(*, now=None) -> dict[str, int]:
    """One pass of the reaper; returns how many runs each rule touched."""
    now = now or timezone.now()
    done = {"timed_out": 0, "heartbeat": 0, "redispatched": 0}
    # Every rule below looks at active runs only (pending, running, paused, resuming, retrying):
    # with none, one indexed probe (``run_live_id_idx``) is the whole pass.
    if not Run.objects.filter(status__in=sorted(ACTIVE_RUN_STATES)).exists():
        done["capped"] = 0
        return done
    for status, seconds, action, code in _timeouts():
        since = now - timedelta(seconds=seconds)
        field = "started_at" if status == Run.Status.RUNNING else "status_changed_at"
        stale = Run.objects.filter(status=status).filter(**{f"{field}__lt": since}).values_list("pk", flat=True)
        for run_id in stale:
            done["timed_out"] += _end(run_id, action, code, f"{status} for more than {seconds} s")
    done["capped"] = services.runs_caps_enforce(now=now)  # gated runs past a time cap stop and escalate
    if not settings.ORCHESTRATOR_RUN_AUTO_RECOVER:  # silent and orphaned runs are left to operators
        return done
    waiting = Job.objects.filter(run_id=OuterRef("pk"), state__in=[JobState.RECEIVED, JobState.QUEUED,
                                                                      JobState.AWAITING_TOOL])
    silent = now - timedelta(seconds=settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S)
    lost = (Run.objects.filter(status=Run.Status.RUNNING)
            .filter(Q(last_heartbeat__lt=silent) | Q(last_heartbeat__isnull=True, status_changed_at__lt=silent))
            .exclude(Exists(waiting)).values_list("pk", flat=True))
    for run_id in lost:
        done["heartbeat"] += _end(run_id, "fail", "heartbeat_timeout",
                                  f"no worker heartbeat for {settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S} s")
    active_jobs = Job.objects.filter(run_id=OuterRef("pk"), state__in=list(ACTIVE_JOB_STATES))
    orphans = (Run.objects.filter(status__in=IN_FLIGHT_RUN_STATES, updated_at__lt=now - ORPHAN_GRACE)
               .exclude(Exists(active_jobs)).values_list("pk", flat=True))
    from runs.execution import run_dispatch

    for run_id in orphans:
        try:
            run_dispatch(run_id)
            done["redispatched"] += 1
        except DomainError as exc:  # queue full: next pass
            logger.warning("could not re-dispatch run %s: %s", run_id, exc)
    return done


def run_heartbeat_hook(*, job_id: int, run_id: int | None) -> None:
    if run_id:
        services.run_heartbeat(run_id=run_id)
