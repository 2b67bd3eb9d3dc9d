"""django-q2 entry points. Idempotent: they take nothing but "go look for work"."""

from __future__ import annotations

import time

from django.conf import settings

from jobs import executor, services, worker


def drain(*args, **kwargs) -> int:
    """Claim and run eligible jobs until none is left or the message's budget is spent.

    The budget (``ORCHESTRATOR_QUEUE_DRAIN_MAX_JOBS`` jobs, ``..._DRAIN_MAX_S`` seconds) keeps
    one message short, so stopping a cluster waits for at most one budget plus one job.
    """
    worker.ensure_started()
    me = worker.worker_id()
    deadline = time.monotonic() + settings.ORCHESTRATOR_QUEUE_DRAIN_MAX_S
    done = 0
    while done < settings.ORCHESTRATOR_QUEUE_DRAIN_MAX_JOBS and time.monotonic() < deadline:
        job = services.job_claim(worker=me)
        if job is None:
            break
        executor.job_run_claimed(job, worker=me)
        done += 1
    return done


def maintenance(*args, **kwargs) -> dict:
    """The scheduled backstop of the workers' own maintenance (every minute)."""
    return worker.maintain()
