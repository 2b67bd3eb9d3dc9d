"""The per-process worker thread: heartbeats, lease renewal and shared maintenance.

Each django-q2 worker process runs one daemon thread that every second renews the lease of the
job the process is executing and, at most once per ``ORCHESTRATOR_QUEUE_MAINTENANCE_INTERVAL_MS``
across all processes, runs maintenance: recover jobs whose worker died, complete jobs past their
deadline, end cancelled jobs that did not stop, and pump wake messages for eligible jobs. A
django-q2 schedule runs the same maintenance every minute as a backstop.

What it costs when there is nothing to do: the worker's heartbeat row is one UPDATE (an INSERT
only the first time, or after the row was deleted), written when the job in hand changes, every
second while a job runs, and every ``HEARTBEAT_IDLE_S`` (a third of the lease) while idle; a
process tries to claim the maintenance turn at most once per interval (one conditional UPDATE);
a maintenance turn first asks one indexed question (``maintenance_due``: is any lease expired,
any deadline passed, any cancelled job still executing, any job waiting?) and runs only the
duties that have work, then each maintenance hook (the run reaper probes the same way).
"""

from __future__ import annotations

import gc
import logging
import os
import random
import socket
import threading
import time
from datetime import timedelta
from typing import Callable

from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

from core.planner import statistics_refresh

logger = logging.getLogger("orchestrator.jobs")

# Extra periodic work of other apps (the run reaper registers here); each takes ``now``.
MAINTENANCE_HOOKS: list[Callable] = []
# Called every second with the job this process executes (``job_id``, ``run_id``): the runs
# app records its run heartbeat here.
HEARTBEAT_HOOKS: list[Callable] = []

_started = threading.Event()
_started_at = None
# What this process last wrote to its heartbeat row: ``(job id, monotonic time)``.
_last_beat: dict[str, object] = {"job_id": None, "at": None}
# When this process tries to claim each maintenance turn next (monotonic), and the marks it knows exist.
_next_try: dict[str, float] = {}
_marks_seen: set[str] = set()


def heartbeat_idle_s() -> float:
    """How often an idle worker refreshes its heartbeat row: a third of the lease (1 s at least),
    so a worker is seen alive (``last_seen`` within the lease) while it lives."""
    return max(1.0, settings.ORCHESTRATOR_QUEUE_LEASE_S / 3)


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


def process_started() -> None:
    """A new django-q2 worker process (its ``post_spawn``), before its first message: the objects it
    inherited from the cluster are frozen out of the garbage collector's view (``gc.freeze``: the
    whole Django process, some 150,000 objects, made each full collection take 120 ms here, during
    which the worker claimed nothing, and the workers of a cluster, doing the same work, reached
    theirs together); its recycling count is drawn (``recycle_spread``); on PostgreSQL its claim is
    planned (``ORCHESTRATOR_QUEUE_WARM_AT_START``, ``claim_warm``); its heartbeat starts."""
    gc.freeze()
    recycle_spread()
    if settings.ORCHESTRATOR_QUEUE_WARM_AT_START:
        _claim_warm()
    ensure_started()


def _claim_warm() -> None:
    """Plan the claim before the first claim, so that a new connection's catalog reads are not made
    under the claim lock (they cost the first claim about 10 ms, and every claim queued behind it)."""
    from django.db import DatabaseError

    from jobs.services import claim_warm

    try:
        claim_warm()
    except DatabaseError:  # the first claim meets the same error and reports it
        logger.warning("could not plan the claim ahead", exc_info=True)


def recycle_spread(seed: int | None = None) -> int:
    """Give this worker process its own recycling count: django-q2's ``recycle`` plus up to
    ``ORCHESTRATOR_Q_RECYCLE_SPREAD`` % more, drawn per process. Wake messages go round the
    workers of a cluster evenly, so with one count for all they reached it together and were
    replaced together: the cluster claimed nothing until the first new process was up (a quarter
    to a third of a second, seen as the p99 of a steady stream). Returns the count this process keeps."""
    from django_q.conf import Conf

    base = int(settings.Q_CLUSTER.get("recycle") or Conf.RECYCLE)
    spread = base * max(0, settings.ORCHESTRATOR_Q_RECYCLE_SPREAD) // 100
    Conf.RECYCLE = base + random.Random(seed).randrange(spread + 1)
    return Conf.RECYCLE


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
    from jobs.services import job_renew_lease

    job_id = CURRENT.get("job_id")
    mono = time.monotonic()
    last_at = _last_beat["at"]
    if not (job_id or job_id != _last_beat["job_id"] or last_at is None or mono - last_at >= heartbeat_idle_s()):
        return
    heartbeat_write(job_id, first=last_at is None)
    _last_beat.update(job_id=job_id, at=mono)
    if job_id:
        job_renew_lease(job_id=job_id, worker=CURRENT.get("worker") or worker_id())
        for hook in HEARTBEAT_HOOKS:
            hook(job_id=job_id, run_id=CURRENT.get("run_id"))
    # With each write (not every idle second): a connection past its age is closed, and the next
    # statement checks the connection first (one more statement when health checks are on).
    close_old_connections()


def heartbeat_write(job_id: int | None, *, first: bool = False) -> None:
    """This process is alive (and executes ``job_id``): one UPDATE of its row, an INSERT when the
    row does not exist (the first beat, or the row was pruned or deleted meanwhile). The first
    beat of a process also sets its cluster and start (a row left by an earlier process of the
    same pid is taken over)."""
    from django.db import IntegrityError

    from jobs.models import WorkerHeartbeat

    now = timezone.now()
    me = worker_id()
    fields = {"last_seen": now, "current_job_id": job_id}
    if first:
        fields.update(cluster=settings.Q_CLUSTER.get("name", ""), started_at=_started_at or now)
    if WorkerHeartbeat.objects.filter(worker=me).update(**fields):
        return
    try:
        WorkerHeartbeat.objects.create(worker=me, last_seen=now, current_job_id=job_id,
                                       cluster=settings.Q_CLUSTER.get("name", ""), started_at=_started_at or now)
    except IntegrityError:  # written by another thread of this process meanwhile
        WorkerHeartbeat.objects.filter(worker=me).update(last_seen=now, current_job_id=job_id)


def _claim_tick(name: str, interval_ms: int) -> bool:
    """True for exactly one process per interval (an atomic conditional UPDATE). A process tries at
    most once per interval: whoever claimed the turn did the work for everyone."""
    from jobs.models import MaintenanceMark

    mono = time.monotonic()
    if mono < _next_try.get(name, 0.0):
        return False
    _next_try[name] = mono + interval_ms / 1000
    now = timezone.now()
    updated = MaintenanceMark.objects.filter(name=name, last_run__lt=now - timedelta(milliseconds=interval_ms)) \
        .update(last_run=now)
    if updated:
        return True
    if name in _marks_seen:
        return False
    _, created = MaintenanceMark.objects.get_or_create(name=name, defaults={"last_run": now})
    _marks_seen.add(name)
    return created


def maybe_maintain() -> None:
    if _claim_tick("maintenance", settings.ORCHESTRATOR_QUEUE_MAINTENANCE_INTERVAL_MS):
        maintain()
    if _claim_tick("planner_statistics", STATISTICS_INTERVAL_MS):
        statistics_refresh()


# How often (at most, across all processes) the hot tables' planner statistics are checked
# (``core.planner.statistics_refresh``: the job table, registered by this app, and the others'
# registered by theirs): often, so that a table growing fast (a fresh database's first minutes) is
# planned for its size soon; the check is one catalog read, and a table is analyzed again only
# once it doubled (or, the job table, once a share of its rows changed).
STATISTICS_INTERVAL_MS = 2_000


def maintain() -> dict[str, int]:
    """Run every maintenance duty that has work (one indexed probe tells which); returns what
    each one did."""
    from jobs import services
    from jobs.selectors import maintenance_due
    from jobs.wake import wake_workers, worker_count

    now = timezone.now()
    due = maintenance_due(now)
    done = {
        "recovered": services.jobs_recover_expired(now=now) if due["recover"] else 0,
        "deadlines": services.jobs_enforce_deadlines(now=now) if due["deadlines"] else 0,
        "interrupted": services.jobs_enforce_interrupt_timeouts(now=now) if due["interrupts"] else 0,
    }
    for hook in MAINTENANCE_HOOKS:
        try:
            hook(now=now)
        except Exception:
            logger.exception("maintenance hook %s failed", getattr(hook, "__name__", hook))
    sent = 0
    if due["waiting"] or done["recovered"]:
        eligible = services.jobs_eligible(now).count()
        if eligible:
            sent = wake_workers(min(eligible, worker_count()), force=True)  # less the messages waiting
    done["woken"] = sent
    return done
