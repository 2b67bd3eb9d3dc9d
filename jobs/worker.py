"""The per-process worker thread: heartbeats, lease renewal and shared maintenance.

Each django-q2 worker process runs one daemon thread that every second records the worker
as alive, renews the lease of the job the process is executing, and, at most once per
``ORCHESTRATOR_QUEUE_MAINTENANCE_INTERVAL_MS`` across all processes, runs maintenance:
recover jobs whose worker died, complete jobs past their deadline, end cancelled jobs that
did not stop, and pump wake messages for eligible jobs. A django-q2 schedule runs the same
maintenance every minute as a backstop.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

logger = logging.getLogger("orchestrator.jobs")

# Extra periodic work of other apps (the run reaper registers here); each takes ``now``.
MAINTENANCE_HOOKS: list[Callable] = []
# Called every second with the job this process executes (``job_id``, ``run_id``): the runs
# app records its run heartbeat here.
HEARTBEAT_HOOKS: list[Callable] = []

_started = threading.Event()
_started_at = None


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def ensure_started() -> None:
    """Start this process's heartbeat thread once."""
    global _started_at
    if _started.is_set():
        return
    _started.set()
    _started_at = timezone.now()
    thread = threading.Thread(target=_loop, name="orchestrator-heartbeat", daemon=True)
    thread.start()


def _loop() -> None:
    while True:
        try:
            beat()
            maybe_maintain()
        except Exception:
            logger.exception("worker heartbeat failed")
            try:
                connection.close()
            except Exception:
                pass
        time.sleep(1.0)


def beat() -> None:
    from jobs.executor import CURRENT
    from jobs.models import WorkerHeartbeat
    from jobs.services import job_renew_lease

    now = timezone.now()
    me = worker_id()
    job_id = CURRENT.get("job_id")
    WorkerHeartbeat.objects.update_or_create(
        worker=me, defaults={"last_seen": now, "current_job_id": job_id,
                             "cluster": settings.Q_CLUSTER.get("name", ""),
                             "started_at": _started_at or now})
    if job_id:
        job_renew_lease(job_id=job_id, worker=CURRENT.get("worker") or me)
        for hook in HEARTBEAT_HOOKS:
            hook(job_id=job_id, run_id=CURRENT.get("run_id"))
    close_old_connections()


def _claim_tick(name: str, interval_ms: int) -> bool:
    """True for exactly one process per interval (an atomic conditional UPDATE)."""
    from jobs.models import MaintenanceMark

    now = timezone.now()
    updated = MaintenanceMark.objects.filter(name=name, last_run__lt=now - timedelta(milliseconds=interval_ms)) \
        .update(last_run=now)
    if updated:
        return True
    _, created = MaintenanceMark.objects.get_or_create(name=name, defaults={"last_run": now})
    return created


def maybe_maintain() -> None:
    if _claim_tick("maintenance", settings.ORCHESTRATOR_QUEUE_MAINTENANCE_INTERVAL_MS):
        maintain()


def maintain() -> dict[str, int]:
    """Run every maintenance duty once; returns what each one did."""
    from jobs import services
    from jobs.wake import broker_backlog, wake_workers, worker_count

    now = timezone.now()
    done = {
        "recovered": services.jobs_recover_expired(now=now),
        "deadlines": services.jobs_enforce_deadlines(now=now),
        "interrupted": services.jobs_enforce_interrupt_timeouts(now=now),
    }
    for hook in MAINTENANCE_HOOKS:
        try:
            hook(now=now)
        except Exception:
            logger.exception("maintenance hook %s failed", getattr(hook, "__name__", hook))
    eligible = services.jobs_eligible(now).count()
    sent = 0
    if eligible:
        backlog = broker_backlog()
        wanted = min(eligible, worker_count()) - backlog
        if wanted > 0:
            sent = wake_workers(wanted, force=True)
    done["woken"] = sent
    return done
