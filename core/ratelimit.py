"""Sliding-window request limits with an atomic store (the API's and the logins' abuse limits).

A principal (``user:<id>`` for an authenticated caller, ``ip:<address>`` otherwise, or any key a
caller names) may make ``limit`` requests in any window of ``period`` seconds, whatever the
window's start: a burst straddling a minute boundary gets no more than one minute's allowance.

The period is cut into ``BUCKETS_PER_PERIOD`` buckets; a request is admitted when the requests
admitted in the buckets that overlap the last ``period`` (the current one, and the one the
window's start falls into, counted in full) number fewer than ``limit``, and only an admitted
request is recorded. Counting the oldest bucket in full makes the limit exact (never more than
``limit`` in any window of ``period``), at the price of a client that spent its allowance
waiting up to one bucket (a tenth of the period) longer than strictly needed.

Each decision is **one atomic step** of the store:

* the database (default): in one transaction, an upsert of the key's anchor row (which locks
  the key: deciders of one key take turns), a read of its buckets, and an upsert of the current
  bucket when admitted, on ``core.RateLimitCounter``; rows of ended windows are pruned;
* Redis (``ORCHESTRATOR_RATE_LIMIT_STORE=redis``, the default when ``REDIS_URL`` is set): a Lua
  script over one hash per key (a field per bucket), expiring on its own.

``rate_limit_hit`` decides and records; ``rate_limit_peek`` only says whether a request would be
admitted (failed logins and token checks are counted with ``hit`` after they fail, and refused
with ``peek`` before anything is checked).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction

from core.models import RateLimitCounter

logger = logging.getLogger("orchestrator.api")

PERIODS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60, "h": 3600, "hour": 3600,
           "d": 86400, "day": 86400}
RATE_PATTERN = re.compile(r"^\s*(\d+)\s*/\s*(\d*)\s*([a-z]+?)s?\s*$")
BUCKETS_PER_PERIOD = 10
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
ANCHOR = EPOCH  # the window_start of a key's anchor row (never a bucket of a counted window)


@dataclass(frozen=True)
class Rate:
    limit: int
    period_s: int

    def __str__(self) -> str:
        return f"{self.limit}/{self.period_s}s"

    @property
    def bucket_us(self) -> int:
        return self.period_s * 1_000_000 // BUCKETS_PER_PERIOD


@dataclass(frozen=True)
class Decision:
    allowed: bool
    count: int  # requests in the window, this one included when it was admitted and recorded
    limit: int
    retry_after_s: int  # 0 when allowed; else the seconds until a request would be admitted


def rate_parse(text: str | None) -> Rate | None:
    """``"600/minute"``, ``"20/s"``, ``"1000/5m"`` → ``Rate``; empty → None (unlimited)."""
    if text is None or not str(text).strip():
        return None
    match = RATE_PATTERN.match(str(text).lower())
    if not match or match.group(3) not in PERIODS or int(match.group(1)) <= 0:
        raise ImproperlyConfigured(f"a rate is <requests>/<period>, e.g. 600/minute or 20/s; got {text!r}")
    multiplier = int(match.group(2)) if match.group(2) else 1
    return Rate(int(match.group(1)), max(1, multiplier) * PERIODS[match.group(3)])


def _bucket_start(index: int, rate: Rate) -> datetime:
    return EPOCH + timedelta(microseconds=index * rate.bucket_us)


_UPSERT = """
INSERT INTO {table} ("key", window_start, count) VALUES (%s, %s, %s)
ON CONFLICT ("key", window_start) DO UPDATE SET count = {table}.count + %s
"""


class DatabaseStore:
    """Buckets in ``core.RateLimitCounter``, decided in one short transaction per request."""

    def decide(self, key: str, rate: Rate, *, current: int, record: bool) -> tuple[bool, dict[int, int]]:
        """Admit (and record, if ``record``) one request of ``key`` in bucket ``current``?
        Returns whether it is admitted and the buckets of the window afterwards."""
        table = connection.ops.quote_name(RateLimitCounter._meta.db_table)
        key = key[:200]
        oldest = current - BUCKETS_PER_PERIOD
        with transaction.atomic(), connection.cursor() as cursor:
            # The anchor row: its row lock makes every decision on this key wait for the one before.
            cursor.execute(_UPSERT.format(table=table),
                           [key, connection.ops.adapt_datetimefield_value(ANCHOR), 0, 0])
            rows = RateLimitCounter.objects.filter(key=key, window_start__gte=_bucket_start(oldest, rate)
                                                   ).values_list("window_start", "count")
            counts = {(start - EPOCH) // timedelta(microseconds=rate.bucket_us): count for start, count in rows}
            allowed = sum(counts.values()) < rate.limit
            if allowed and record:
                cursor.execute(_UPSERT.format(table=table),
                               [key, connection.ops.adapt_datetimefield_value(_bucket_start(current, rate)), 1, 1])
                counts[current] = counts.get(current, 0) + 1
        return allowed, counts


_DECIDE_SCRIPT = """
local fields = redis.call('HGETALL', KEYS[1])
local oldest = tonumber(ARGV[2])
local total = 0
local out = {0}
for i = 1, #fields, 2 do
  local bucket = tonumber(fields[i])
  if bucket < oldest then
    redis.call('HDEL', KEYS[1], fields[i])
  else
    local count = tonumber(fields[i + 1])
    total = total + count
    table.insert(out, fields[i])
    table.insert(out, count)
  end
end
if total < tonumber(ARGV[3]) then
  out[1] = 1
  if ARGV[4] == '1' then
    local count = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
    redis.call('PEXPIRE', KEYS[1], ARGV[5])
    local found = false
    for i = 2, #out, 2 do
      if out[i] == ARGV[1] then out[i + 1] = count; found = true end
    end
    if not found then table.insert(out, ARGV[1]); table.insert(out, count) end
  end
end
return out
"""


class RedisStore:
    """Buckets in one Redis hash per key, decided by a Lua script (atomic), expiring on their own."""

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

    @staticmethod
    def name(key: str) -> str:
        return f"orchestrator:ratelimit:{key}"

    def decide(self, key: str, rate: Rate, *, current: int, record: bool) -> tuple[bool, dict[int, int]]:
        expire_ms = (BUCKETS_PER_PERIOD + 2) * rate.bucket_us // 1000 + 1
        reply = self.client().eval(_DECIDE_SCRIPT, 1, self.name(key), str(current),
                                   str(current - BUCKETS_PER_PERIOD), str(rate.limit), "1" if record else "0",
                                   str(expire_ms))
        pairs = reply[1:]
        counts = {int(pairs[i]): int(pairs[i + 1]) for i in range(0, len(pairs), 2)}
        return bool(int(reply[0])), counts


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


def _retry_after(counts: dict[int, int], rate: Rate, now: float) -> int:
    """Seconds until enough of the oldest counted requests have left the window for one more."""
    excess = sum(counts.values()) - rate.limit + 1
    seen = 0
    for bucket in sorted(counts):
        seen += counts[bucket]
        if seen >= excess:
            leaves_at = (bucket + BUCKETS_PER_PERIOD + 1) * rate.bucket_us / 1_000_000
            return max(1, math.ceil(leaves_at - now))
    return rate.period_s


def _decide(key: str, rate: Rate, *, now: float | None, store, record: bool) -> Decision:
    now = time.time() if now is None else now
    current = int(now * 1_000_000) // rate.bucket_us
    store = store or rate_limit_store()
    try:
        allowed, counts = store.decide(key, rate, current=current, record=record)
    except Exception as exc:
        if isinstance(store, DatabaseStore):
            raise
        logger.warning("rate limit store unavailable (%s: %s); request allowed", type(exc).__name__, exc)
        return Decision(True, 0, rate.limit, 0)
    count = sum(counts.values())
    return Decision(allowed, count, rate.limit, 0 if allowed else _retry_after(counts, rate, now))


def rate_limit_hit(key: str, rate: Rate, *, now: float | None = None, store=None) -> Decision:
    """Decide one request of ``key`` and record it when it is admitted.

    If the Redis store cannot be reached the request is allowed (and logged): the limits protect
    the service, they must not take it down with them.
    """
    return _decide(key, rate, now=now, store=store, record=True)


def rate_limit_peek(key: str, rate: Rate, *, now: float | None = None, store=None) -> Decision:
    """Would a request of ``key`` be admitted now? Records nothing."""
    return _decide(key, rate, now=now, store=store, record=False)


def rate_limit_longest_period_s() -> int:
    """The longest period of the configured limits (how long a counter row can matter)."""
    texts = (settings.ORCHESTRATOR_API_RATE, settings.ORCHESTRATOR_API_ANON_RATE,
             settings.ORCHESTRATOR_LOGIN_USERNAME_FAILURES, settings.ORCHESTRATOR_LOGIN_ADDRESS_FAILURES)
    return max((rate.period_s for rate in map(rate_parse, texts) if rate), default=0)


def rate_limit_prune(*, now: float | None = None, batch: int = 5000) -> int:
    """Delete database counters of windows that ended (at most ``batch`` rows); returns how many."""
    now = time.time() if now is None else now
    longest = rate_limit_longest_period_s()
    cutoff = datetime.fromtimestamp(now - max(longest * 11 // 10 + 1, 60), tz=timezone.utc)
    ids = list(RateLimitCounter.objects.filter(window_start__lt=cutoff).values_list("pk", flat=True)[:batch])
    if not ids:
        return 0
    deleted, _ = RateLimitCounter.objects.filter(pk__in=ids).delete()
    return deleted


# --- failed authentication ---------------------------------------------------------------------

def client_address(meta) -> str:
    """The client's address from a request's ``META`` (or an equivalent mapping): the
    connection's own, or the one the n-th trusted proxy put into ``X-Forwarded-For``
    (``ORCHESTRATOR_TRUSTED_PROXIES``), exactly as the API's limits key on it."""
    from types import SimpleNamespace

    from django.http.request import HttpHeaders
    from rest_framework.throttling import BaseThrottle

    request = SimpleNamespace(META=meta, headers=HttpHeaders(meta))
    return BaseThrottle().get_ident(request) or "unknown"


def _address_failure_rate() -> Rate | None:
    return rate_parse(settings.ORCHESTRATOR_API_ANON_RATE or settings.ORCHESTRATOR_API_RATE)


def auth_failures_refusal(address: str) -> Decision | None:
    """The refusal when ``address`` has spent its allowance of failed authentications (the API's
    per-address limit, ``ip:<address>``, shared with the API), else None. Call it before checking
    a token: a refused attempt checks nothing."""
    rate = _address_failure_rate()
    if rate is None:
        return None
    decision = rate_limit_peek(f"ip:{address}", rate)
    return None if decision.allowed else decision


def auth_failure_record(address: str) -> None:
    """Count one failed authentication of ``address`` (after a token was checked and refused)."""
    rate = _address_failure_rate()
    if rate is not None:
        rate_limit_hit(f"ip:{address}", rate)


def retry_after_text(seconds: int) -> str:
    """``45`` → "45 seconds", ``600`` → "10 minutes"."""
    return f"{seconds} seconds" if seconds < 120 else f"{math.ceil(seconds / 60)} minutes"
