"""django-q2 messages: each one means "a job may be ready"; the worker claims the best one.

Within one process, wake messages are coalesced (at most one per
``ORCHESTRATOR_QUEUE_WAKE_COALESCE_MS``): a
worker drains many jobs per message. A wake asked for inside the window is not dropped: one
message is sent when the window ends (a job enqueued just after a worker's drain found the
queue empty waits at most the window, not the maintenance pump's interval). The pump still
re-issues messages whenever eligible jobs wait with no message in the broker (lost messages,
retries whose backoff has passed). An enqueue of many jobs asks for a message per claim batch they
fill, the pump for one per waiting job, each at most as many as the deployment has live workers, in
every cluster (``worker_count``); a drain whose claim came back full wakes one more worker while jobs
are due, so the workers join as the backlog asks for them.

On PostgreSQL a worker whose drain found the queue empty can linger (off by default) for
``ORCHESTRATOR_QUEUE_DRAIN_LINGER_MS`` listening on ``CHANNEL`` (``linger``), and an enqueue
that queues a job claimable now notifies it in its own transaction (``notify_enqueued``,
delivered at commit): the lingering worker claims the job without waiting for a wake message to
go through the broker. The wake message is still sent; a drain it starts finds the job taken
and lingers in its turn. A notification lost (the worker between two statements, a reconnect)
costs only the usual path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta

from django.conf import settings

logger = logging.getLogger("orchestrator.jobs")

_lock = threading.Lock()
_last_wake = 0.0
_deferred: threading.Timer | None = None  # the message that ends the current window, if asked for


# This process's broker client (django-q2's ``get_broker`` builds a new one, with a new Redis
# connection, on every call): built on the first message, dropped after a failed send and in a
# forked child (a connection is never shared across a fork).
_broker: dict[str, object] = {"client": None}


def _after_fork_in_child() -> None:
    global _lock, _deferred
    _lock = threading.Lock()
    _deferred = None  # the parent's timer thread does not exist here
    _broker["client"] = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _client():
    """This process's broker client (``_broker``)."""
    from django_q.brokers import get_broker

    with _lock:
        if _broker["client"] is None:
            _broker["client"] = get_broker()
        return _broker["client"]


def _send(count: int) -> None:
    from django_q.tasks import async_task

    broker = _client()
    try:
        for _ in range(count):
            async_task("jobs.tasks.drain", save=False, ack_failure=True, broker=broker)
    except Exception:
        _broker["client"] = None  # the next message builds a new client
        raise


def waiting_messages() -> int:
    """Wake messages in the broker that no cluster has taken yet (0 when the broker cannot say)."""
    try:
        return _client().queue_size() or 0
    except Exception:
        logger.debug("could not read the broker's queue size", exc_info=True)
        return 0


def wake_workers(count: int = 1, *, force: bool = False) -> int:
    """Make sure ``count`` wake messages wait in the broker (coalesced unless ``force``): the
    messages no cluster has taken yet (``waiting_messages``) count, as each starts a drain after
    this call, which claims until the queue is empty; only the rest are sent. A message costs more
    than the read: on the ORM broker it is three write transactions (insert, lease, delete), and a
    drain that finds the jobs taken costs a claim. Returns how many were sent."""
    global _last_wake, _deferred
    if count <= 0:
        return 0
    now = time.monotonic()
    window_ms = settings.ORCHESTRATOR_QUEUE_WAKE_COALESCE_MS
    with _lock:
        elapsed_ms = (now - _last_wake) * 1000
        if not force and elapsed_ms < window_ms:
            if _deferred is None:
                _deferred = threading.Timer((window_ms - elapsed_ms) / 1000, _wake_deferred)
                _deferred.daemon = True
                _deferred.start()
            return 0
        _last_wake = now
    count -= waiting_messages()
    if count <= 0:
        return 0
    try:
        _send(count)
    except Exception:  # the broker is down: the pump re-issues once it is back
        logger.exception("could not send a wake message")
        return 0
    return count


def _wake_deferred() -> None:
    global _deferred
    with _lock:
        _deferred = None
    wake_workers(1, force=True)


CHANNEL = "orchestrator_jobs"
# The driver connection this process listens on (a new one after a reconnect listens again).
_listening: dict[str, object] = {"connection": None}


def notify_enqueued() -> None:
    """Tell lingering workers that a job claimable now was queued (PostgreSQL; sent at commit,
    once per transaction however often it is called)."""
    from django.db import connection

    if connection.vendor == "postgresql" and settings.ORCHESTRATOR_QUEUE_DRAIN_LINGER_MS > 0:
        with connection.cursor() as cursor:
            cursor.execute(f"NOTIFY {CHANNEL}")


def listen_mark() -> bool:
    """Before a claim: listen on this process's connection (once per connection) and forget the
    notifications received so far, so that ``linger`` after the claim answers for jobs enqueued
    since. False where lingering is off (not PostgreSQL, 0 ms, inside a transaction)."""
    from django.db import connection

    if connection.vendor != "postgresql" or settings.ORCHESTRATOR_QUEUE_DRAIN_LINGER_MS <= 0 \
            or connection.in_atomic_block:
        return False
    connection.ensure_connection()
    raw = connection.connection
    if _listening["connection"] is not raw:
        with connection.cursor() as cursor:
            cursor.execute(f"LISTEN {CHANNEL}")
        _listening["connection"] = raw
    for _ in raw.notifies(timeout=0):  # the ones received while it executed jobs: old news
        pass
    return True


def linger(listening: bool, until: float) -> bool:
    """After a claim found nothing: wait, until ``until`` (monotonic) at the latest and at most the
    linger setting, for a job enqueued since ``listen_mark``. True when one was notified (also
    while the claim ran: the driver keeps those): claim again. False when the time ran out or
    lingering is off."""
    from django.db import connection

    if not listening or _listening["connection"] is not connection.connection:
        return False
    timeout = min(until - time.monotonic(), settings.ORCHESTRATOR_QUEUE_DRAIN_LINGER_MS / 1000)
    try:
        for _ in connection.connection.notifies(timeout=max(0.0, timeout), stop_after=1):
            return True
    except Exception:  # the connection broke: the next statement reconnects, the usual path goes on
        logger.warning("lingering for jobs stopped: the database connection failed", exc_info=True)
    return False


def enqueue_wake_count(queued: int) -> int:
    """Wake messages for ``queued`` jobs enqueued together: one per claim batch they fill
    (``ORCHESTRATOR_QUEUE_CLAIM_BATCH``: a worker of quick jobs claims that many in one statement), at
    most the deployment's live workers (``worker_count``). A message per job woke every worker for a
    handful of jobs: with two clusters, four drains raced for five jobs, three of them claimed nothing
    under the claim lock, and the p50 of queued → executing at 500 jobs/s was 10-14 ms against 8 ms
    with one message. Jobs claimed one at a time (slow ones) still spread over the workers: a drain
    whose claim came back full wakes one more worker while jobs are due (``jobs.tasks.drain``)."""
    batch = max(1, settings.ORCHESTRATOR_QUEUE_CLAIM_BATCH)
    return min(-(-queued // batch), worker_count()) if queued > 0 else 0


# How long a process trusts its count of the deployment's live workers (``worker_count``).
WORKERS_SEEN_TTL_S = 5.0
_workers_seen: dict[str, float] = {"count": 0, "at": float("-inf")}


def worker_count() -> int:
    """How many wake messages a burst of work can use at once: the live worker processes of the
    whole deployment (every cluster, every machine: the heartbeat rows younger than a job lease), at
    least this cluster's own ``workers``. With several clusters on one broker, this cluster's own
    count woke only as many workers as one cluster has, and a drain hands on one message: the other
    clusters' workers stayed idle through a backlog. One ``COUNT`` of the heartbeat rows at most
    every ``WORKERS_SEEN_TTL_S`` per process; the last count when the database cannot say (a wake
    is called after an enqueue's commit: it never fails the enqueue)."""
    from django.db import DatabaseError
    from django.utils import timezone

    from jobs.models import WorkerHeartbeat
    from jobs.selectors import worker_alive_window_s  # (it imports the services, which import this module)

    mono = time.monotonic()
    if mono - _workers_seen["at"] >= WORKERS_SEEN_TTL_S:
        alive_since = timezone.now() - timedelta(seconds=worker_alive_window_s())
        try:
            _workers_seen["count"] = WorkerHeartbeat.objects.filter(last_seen__gte=alive_since).count()
        except DatabaseError:
            logger.warning("could not count the live workers: waking as many as last counted", exc_info=True)
        _workers_seen["at"] = mono
    return max(int(settings.Q_CLUSTER.get("workers") or 1), int(_workers_seen["count"]))
