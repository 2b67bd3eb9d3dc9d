"""Fixed-window request counters with an atomic store (the API's abuse limits).

A principal (``user:<id>`` for an authenticated caller, ``ip:<address>`` otherwise) may make
``limit`` requests per window of ``period`` seconds. Each request increments its window's
counter in **one atomic operation** and learns the new count from it:

* the database (default): ``INSERT ... ON CONFLICT (key, window_start) DO UPDATE SET count =
  count + 1 RETURNING count`` on ``core.RateLimitCounter``; windows that ended are pruned;
* Redis (``ORCHESTRATOR_RATE_LIMIT_STORE=redis``, the default when ``REDIS_URL`` is set):
  ``SET key 0 EX <2 periods> NX`` then ``INCR key`` in one ``MULTI``.

Never a read followed by a write, so concurrent requests in any number of processes cannot
both slip under the limit.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from core.models import RateLimitCounter

logger = logging.getLogger("orchestrator.api")

PERIODS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600,
           "d": 86400, "day": 86400}
RATE_PATTERN = re.compile(r"^\s*(\d+)\s*/\s*(\d*)\s*([a-z]+?)s?\s*$")


@dataclass(frozen=True)
class Rate:
    limit: int
    period_s: int

    def __str__(self) -> str:
        return f"{self.limit}/{self.period_s}s"


@dataclass(frozen=True)
class Decision:
    allowed: bool
    count: int
    limit: int
    retry_after_s: int  # until the window ends


def rate_parse(text: str | None) -> Rate | None:
    """``"600/minute"``, ``"20/s"``, ``"1000/5m"`` → ``Rate``; empty → None (unlimited)."""
    if text is None or not str(text).strip():
        return None
    match = RATE_PATTERN.match(str(text).lower())
    if not match or match.group(3) not in PERIODS or int(match.group(1)) <= 0:
        raise ImproperlyConfigured(f"a rate is <requests>/<period>, e.g. 600/minute or 20/s; got {text!r}")
    multiplier = int(match.group(2)) if match.group(2) else 1
    return Rate(int(match.group(1)), max(1, multiplier) * PERIODS[match.group(3)])


_UPSERT = """
INSERT INTO {table} ("key", window_start, count) VALUES (%s, %s, 1)
ON CONFLICT ("key", window_start) DO UPDATE SET count = {table}.count + 1
RETURNING count
"""


class DatabaseStore:
    """Counters in ``core.RateLimitCounter`` (one upsert per request, in autocommit)."""

    def increment(self, key: str, window_start: float, period_s: int) -> int:
        table = connection.ops.quote_name(RateLimitCounter._meta.db_table)
        start = datetime.fromtimestamp(window_start, tz=timezone.utc)
        with connection.cursor() as cursor:
            cursor.execute(_UPSERT.format(table=table),
                           [key[:200], connection.ops.adapt_datetimefield_value(start)])
            return int(cursor.fetchone()[0])


class RedisStore:
    """Counters in Redis, expiring on their own two windows after they start."""

    _clients: dict[str, object] = {}
    _lock = threading.Lock()

    def client(self):
        """One client per URL and process, made once: a client dropped while another thread
        still pipelines through its pool would close that thread's connection."""
        import redis

        url = settings.REDIS_URL
        with self._lock:
            client = self._clients.get(url)
            if client is None:
                client = self._clients[url] = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
        return client

    def increment(self, key: str, window_start: float, period_s: int) -> int:
        name = f"orchestrator:ratelimit:{key}:{int(window_start)}"
        pipeline = self.client().pipeline(transaction=True)
        pipeline.set(name, 0, ex=2 * period_s, nx=True)
        pipeline.incr(name)
        return int(pipeline.execute()[1])


def rate_limit_store():
    """The configured store: ``database`` or ``redis``."""
    kind = settings.ORCHESTRATOR_RATE_LIMIT_STORE
    if kind == "redis":
        if not settings.REDIS_URL:
            raise ImproperlyConfigured("ORCHESTRATOR_RATE_LIMIT_STORE=redis needs REDIS_URL")
        return RedisStore()
    if kind == "database":
        return DatabaseStore()
    raise ImproperlyConfigured(f"ORCHESTRATOR_RATE_LIMIT_STORE is database or redis, not {kind!r}")


def rate_limit_hit(key: str, rate: Rate, *, now: float | None = None, store=None) -> Decision:
    """Count one request of ``key`` in its current window and say whether it is allowed.

    If the Redis store cannot be reached the request is allowed (and logged): the limits protect
    the service, they must not take it down with them.
    """
    now = time.time() if now is None else now
    window_start = math.floor(now / rate.period_s) * rate.period_s
    retry_after = max(1, math.ceil(window_start + rate.period_s - now))
    store = store or rate_limit_store()
    try:
        count = store.increment(key, window_start, rate.period_s)
    except Exception as exc:
        if isinstance(store, DatabaseStore):
            raise
        logger.warning("rate limit store unavailable (%s: %s); request allowed", type(exc).__name__, exc)
        return Decision(True, 0, rate.limit, retry_after)
    return Decision(count <= rate.limit, count, rate.limit, retry_after)


def rate_limit_prune(*, now: float | None = None, batch: int = 5000) -> int:
    """Delete database counters of windows that ended (at most ``batch`` rows); returns how many."""
    now = time.time() if now is None else now
    longest = max((rate.period_s for rate in (rate_parse(settings.ORCHESTRATOR_API_RATE),
                                              rate_parse(settings.ORCHESTRATOR_API_ANON_RATE)) if rate), default=0)
    cutoff = datetime.fromtimestamp(now - max(longest, 60), tz=timezone.utc)
    ids = list(RateLimitCounter.objects.filter(window_start__lt=cutoff).values_list("pk", flat=True)[:batch])
    if not ids:
        return 0
    deleted, _ = RateLimitCounter.objects.filter(pk__in=ids).delete()
    return deleted
