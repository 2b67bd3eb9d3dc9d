"""Run the queue in this process: claim and execute jobs until a condition holds."""

from __future__ import annotations

import time

from jobs.executor import job_run_claimed
from jobs.services import job_claim


def drain_jobs(*, until=None, timeout: float = 20.0, worker: str = "inline") -> int:
    """Execute eligible jobs (waiting out backoffs) until ``until()`` is true or nothing is left."""
    from jobs.models import ACTIVE_JOB_STATES, Job

    deadline = time.monotonic() + timeout
    done = 0
    while time.monotonic() < deadline:
        if until is not None and until():
            return done
        job = job_claim(worker=worker)
        if job is not None:
            job_run_claimed(job, worker=worker)
            done += 1
            continue
        if until is None and not Job.objects.filter(state__in=list(ACTIVE_JOB_STATES)).exists():
            return done
        time.sleep(0.02)
    if until is not None and until():
        return done
    raise AssertionError(f"jobs did not settle within {timeout}s")
