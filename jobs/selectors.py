"""Reads of the queue for operators: depth by lane and type, executing jobs, workers seen."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db.models import Count, Min, Q
from django.utils import timezone

from jobs.models import WAITING_JOB_STATES, Job, JobState, WorkerHeartbeat

WAITING = list(WAITING_JOB_STATES)


def _age_s(since, now) -> float | None:
    return None if since is None else round((now - since).total_seconds(), 1)


def queue_status(*, now=None, limit: int = 50) -> dict[str, Any]:
    """A snapshot of the queue in four grouped queries (whatever the number of jobs).

    ``lanes``: waiting (claimable states) and executing jobs per lane and type, with the age of
    the oldest waiting one; ``executing``: the ``limit`` oldest executing jobs with their age and
    lease; ``workers``: worker processes by last heartbeat, alive when seen within one lease.
    """
    now = now or timezone.now()
    active = Job.objects.filter(state__in=[*WAITING, JobState.EXECUTING])
    lanes = [
        {"lane": row["lane"], "type": row["type"], "waiting": row["waiting"], "executing": row["executing"],
         "oldest_waiting_s": _age_s(row["oldest"], now)}
        for row in active.values("lane", "type").annotate(
            waiting=Count("id", filter=Q(state__in=WAITING)),
            executing=Count("id", filter=Q(state=JobState.EXECUTING)),
            oldest=Min("queued_at", filter=Q(state__in=WAITING)),
        ).order_by("lane", "type")
    ]
    executing = [
        {"id": row["id"], "type": row["type"], "lane": row["lane"], "project": row["project_id"], "run": row["run_id"],
         "worker": row["worker"], "attempt": row["attempts"], "age_s": _age_s(row["started_at"], now),
         "lease_left_s": None if row["lease_expires_at"] is None
         else round((row["lease_expires_at"] - now).total_seconds(), 1),
         "cancel_requested": row["cancel_requested_at"] is not None}
        for row in Job.objects.filter(state=JobState.EXECUTING).order_by("started_at", "id").values(
            "id", "type", "lane", "project_id", "run_id", "worker", "attempts", "started_at", "lease_expires_at",
            "cancel_requested_at")[:limit]
    ]
    totals = dict(Job.objects.filter(state__in=[JobState.RECEIVED, *WAITING, JobState.EXECUTING,
                                                JobState.AWAITING_USER_CONFIRMATION])
                  .values_list("state").annotate(n=Count("id")).order_by())
    alive_window = settings.ORCHESTRATOR_QUEUE_LEASE_S
    workers = [
        {"worker": row["worker"], "cluster": row["cluster"], "last_seen_s": _age_s(row["last_seen"], now),
         "alive": (now - row["last_seen"]).total_seconds() <= alive_window, "current_job": row["current_job_id"],
         "jobs_done": row["jobs_done"], "up_s": _age_s(row["started_at"], now)}
        for row in WorkerHeartbeat.objects.order_by("-last_seen").values(
            "worker", "cluster", "last_seen", "current_job_id", "jobs_done", "started_at")[:limit]
    ]
    return {
        "at": now.isoformat(),
        "waiting": sum(totals.get(state, 0) for state in WAITING),
        "executing": totals.get(JobState.EXECUTING, 0),
        "received": totals.get(JobState.RECEIVED, 0),
        "awaiting_user_confirmation": totals.get(JobState.AWAITING_USER_CONFIRMATION, 0),
        "concurrency": settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY,
        "lanes": lanes,
        "executing_jobs": executing,
        "workers": workers,
    }
