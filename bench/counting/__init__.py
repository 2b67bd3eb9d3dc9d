"""Benchmark instruments: an execution side channel and SQL statement / transaction counters.

**Executions.** ``counted(key, total, redis_url)`` is the work of one benchmark job in every
stack (our queue's ``bench_counted`` job type, bare django-q2, Celery): one Redis round trip
that adds 1 to ``key``'s field of the hash ``bench:exec`` and to the counter ``bench:done``,
and stamps the time of the first and of the ``total``-th execution. ``executions_check`` then
tells lost keys (never executed) and keys executed more than once.

**Statements and transactions.** ``install()`` counts, in this process, every SQL statement run
through a Django cursor (savepoints included; ``BEGIN``/``COMMIT`` are not statements here; on
PostgreSQL Django's connection health check ``SELECT 1`` too) and
every transaction: each commit or rollback of an atomic block plus each statement run in
autocommit mode (the server makes each one a transaction). A daemon thread adds the counts to
Redis (``bench:count:*``) every 0.2 s and once more when the process exits normally, so the
counts of all the worker processes of a cluster add up in one place. ``BENCH_COUNT_URL`` turns
it on in the benchmarks' child processes (``bench/settings.py``); ``paused()`` leaves the
benchmark's own polling out.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

EXEC_HASH = "bench:exec"
DONE = "bench:done"
STATEMENTS = "bench:count:statements"
TRANSACTIONS = "bench:count:transactions"
FLUSH_INTERVAL_S = 0.2

_clients: dict = {}


def _redis(url: str):
    import redis

    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(url)
    return client


def trivial(value):
    """The work of one job: what our ``noop`` job type returns for ``{"value": value}``."""
    return {"echo": value}


# The execution also stamped on its way (``counted_rate(url, MARK)``: the rate of the first ones).
MARK = 1000


def counted(key, total: int, redis_url: str):
    """``trivial``, then count this execution of ``key`` (one Redis round trip)."""
    result = trivial(key)
    client = _redis(redis_url)
    pipe = client.pipeline(transaction=False)
    pipe.hincrby(EXEC_HASH, str(key), 1)
    pipe.incr(DONE)
    done = pipe.execute()[1]
    if done == 1 or done == total or done == MARK:
        client.set(f"{DONE}:{done}", repr(time.time()))
    return result


def counted_rate(redis_url: str, n: int) -> float:
    """n / (first execution → n-th execution), from the stamps ``counted`` leaves."""
    client = _redis(redis_url)
    first, last = float(client.get(f"{DONE}:1")), float(client.get(f"{DONE}:{n}"))
    return n / max(last - first, 1e-6)


def wait_counted(redis_url: str, n: int, *, stall_s: float = 60, interval: float = 0.1) -> None:
    """Wait until ``n`` executions were counted; fail once nothing moved for ``stall_s``."""
    client = _redis(redis_url)
    last_value, last_change = -1, time.monotonic()
    while True:
        value = int(client.get(DONE) or 0)
        if value >= n:
            return
        if value != last_value:
            last_value, last_change = value, time.monotonic()
        elif time.monotonic() - last_change > stall_s:
            raise TimeoutError(f"{value} of {n} executions counted and nothing moved for {stall_s:.0f} s")
        time.sleep(interval)


def executions_check(redis_url: str, expected_keys) -> list[str]:
    """Problems with the executions counted (empty: each expected key ran exactly once)."""
    counts = {key.decode(): int(value) for key, value in _redis(redis_url).hgetall(EXEC_HASH).items()}
    expected = {str(key) for key in expected_keys}
    lost = sorted(expected - counts.keys(), key=lambda k: (len(k), k))
    twice = sorted((k for k, v in counts.items() if v > 1), key=lambda k: (len(k), k))
    unknown = sorted(counts.keys() - expected, key=lambda k: (len(k), k))
    problems = []
    if lost:
        problems.append(f"{len(lost)} LOST (never executed), e.g. {lost[:10]}")
    if twice:
        problems.append(f"{len(twice)} RUN MORE THAN ONCE, e.g. {[(k, counts[k]) for k in twice[:10]]}")
    if unknown:
        problems.append(f"{len(unknown)} executions of unexpected keys, e.g. {unknown[:10]}")
    return problems


# --- our job type ----------------------------------------------------------------------------

def _validate(payload: dict) -> dict:
    from core.errors import ValidationFailed

    if not isinstance(payload.get("total"), int) or not isinstance(payload.get("redis"), str):
        raise ValidationFailed("invalid payload", errors={"payload": ["total (int) and redis (URL) are required"]})
    return payload


def _run(ctx, payload: dict):
    counted(ctx.job_id, payload["total"], payload["redis"])
    return {"echo": payload.get("value"), "attempt": ctx.attempt}


def register_job_type() -> None:
    """``bench_counted``: ``noop``'s definition (no lane, background) running ``counted``."""
    from jobs.registry import Dedupe, JobDefinition, RetryPolicy, register

    register(JobDefinition(type="bench_counted", run=_run, validate=_validate, priority_class="background",
                           lane="none", dedupe=Dedupe("none"), retry=RetryPolicy(max_attempts=3), timeout_s=65))


# --- statement and transaction counters ------------------------------------------------------

_lock = threading.Lock()
_counts = {"statements": 0, "transactions": 0}
_flushed = {"statements": 0, "transactions": 0}
_state = {"pid": None, "url": None, "installed": False}
_paused = threading.local()


def _add(name: str) -> None:
    if getattr(_paused, "on", False):
        return
    if _state["url"] and _state["pid"] != os.getpid():
        _start_flusher()  # the first count of a forked child
    with _lock:
        _counts[name] += 1


def _wrapper(execute, sql, params, many, context):
    _add("statements")
    connection = context["connection"]
    if not connection.in_atomic_block and connection.get_autocommit():
        _add("transactions")
    return execute(sql, params, many, context)


def _attach(connection) -> None:
    if _wrapper not in connection.execute_wrappers:
        connection.execute_wrappers.append(_wrapper)
    klass = type(connection)
    if connection.vendor == "postgresql" and not getattr(klass, "_bench_counted", False):
        # Django's connection health check runs ``SELECT 1`` on the driver's connection, past the
        # execute wrappers: one autocommit statement.
        is_usable = klass.is_usable

        def counted_is_usable(self):
            _add("statements")
            _add("transactions")
            return is_usable(self)

        klass.is_usable, klass._bench_counted = counted_is_usable, True


def install(flush_url: str | None = None) -> None:
    """Count this process's statements and transactions (and its children's: fork keeps it)."""
    if _state["installed"]:
        return
    _state["installed"] = True
    _state["url"] = flush_url
    from django.db import connections
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.backends.signals import connection_created

    commit, rollback = BaseDatabaseWrapper.commit, BaseDatabaseWrapper.rollback

    def counted_commit(self):
        _add("transactions")
        return commit(self)

    def counted_rollback(self):
        _add("transactions")
        return rollback(self)

    BaseDatabaseWrapper.commit, BaseDatabaseWrapper.rollback = counted_commit, counted_rollback
    connection_created.connect(lambda sender, connection, **kwargs: _attach(connection), weak=False,
                               dispatch_uid="bench-counting")
    for connection in connections.all(initialized_only=True):
        _attach(connection)
    os.register_at_fork(after_in_child=_after_fork_in_child)
    if flush_url:
        _start_flusher()


def _flush() -> None:
    with _lock:
        delta = {name: _counts[name] - _flushed[name] for name in _counts}
        _flushed.update(_counts)
    if any(delta.values()):
        pipe = _redis(_state["url"]).pipeline(transaction=False)
        pipe.incrby(STATEMENTS, delta["statements"])
        pipe.incrby(TRANSACTIONS, delta["transactions"])
        pipe.execute()


def _after_fork_in_child() -> None:
    """A forked child counts from zero with a fresh lock (the parent's may have been held)."""
    global _lock
    _lock = threading.Lock()
    _counts.update(statements=0, transactions=0)
    _flushed.update(statements=0, transactions=0)
    _clients.clear()
    _state["pid"] = None  # its flushing thread starts with its first count


def _start_flusher() -> None:
    """One flushing thread per process."""
    with _lock:
        if _state["pid"] == os.getpid():
            return
        _state["pid"] = os.getpid()
    import multiprocessing.util

    def loop():
        while True:
            time.sleep(FLUSH_INTERVAL_S)
            try:
                _flush()
            except Exception:  # Redis away for a moment: the next flush carries the counts
                pass

    threading.Thread(target=loop, name="bench-counting", daemon=True).start()
    # A multiprocessing child leaves through os._exit (no atexit), but runs these finalizers.
    multiprocessing.util.Finalize(None, _flush, exitpriority=100)


def local_counts() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def flushed_counts(redis_url: str) -> dict[str, int]:
    client = _redis(redis_url)
    return {"statements": int(client.get(STATEMENTS) or 0), "transactions": int(client.get(TRANSACTIONS) or 0)}


@contextlib.contextmanager
def paused():
    """Leave what this thread runs inside out of the counts."""
    previous = getattr(_paused, "on", False)
    _paused.on = True
    try:
        yield
    finally:
        _paused.on = previous
