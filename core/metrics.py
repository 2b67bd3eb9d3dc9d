"""Prometheus metrics at ``/metrics``, computed from the database when scraped.

Every figure comes from the database, so any process (several daphne behind a load balancer,
any number of ``qcluster`` workers) answers the same numbers; nothing is counted in process
memory. Four sources:

* **Counters and histograms derived from the tables** (``DERIVED``): the job counters (attempts,
  retries, completions, failures and cancels by type and reason, run and wait time) are read
  from the job table, and the finished runs from the run attempts: a transition writes nothing
  but its own row. Each app registers a ``Derived`` source (its SQL, and how its rows become
  series) from its ``AppConfig.ready``.
* **The base** (``MetricTotal`` plus pending ``MetricDelta`` rows): what rows that are gone still
  count. Deleting a job (the retention prune, or any ``Job`` delete) adds the deleted rows'
  counts here in the deleting transaction, so a counter never goes down; the rare counts no row
  keeps (enqueues, dedupe hits) are ``MetricDelta`` rows inserted in the transaction of the
  change they count. The write path only inserts, so no two transactions wait for each other
  on a counter row; ``metrics_compact`` folds the rows into ``MetricTotal`` in batches (on
  every scrape and every prune). A scrape reads the base and every derived source in **one
  statement** (one snapshot), so a concurrent prune or fold is never counted twice or missed.
* **The apps' families**: each app above core registers a collector in ``COLLECTORS`` (and a
  fold in ``COMPACTORS``) from its ``AppConfig.ready``: ``billing.metrics`` (credits reserved,
  ledger entries by kind, rolled up from the append-only ledger), ``jobs.metrics`` (queue depth
  and wait, executing jobs, workers alive), ``runs.metrics`` (runs by state, stuck runs,
  escalations, the last invariants check). They are grouped queries over live rows.
* Relay lag is the lag of the relays running in the process that answers the scrape.

Access: ``Authorization: Bearer <ORCHESTRATOR_METRICS_TOKEN>``, or a staff session.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Callable, Iterable, Iterator

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.http import HttpResponse, JsonResponse
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from core.inserts import insert_tree
from core.models import Event, MetricDelta, MetricTotal
from core.ratelimit import auth_failure_record, auth_failures_refusal, client_address, retry_after_text

logger = logging.getLogger("orchestrator.metrics")

# Seconds; a job's run time (started → terminal) and wait (queued → first start).
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0, math.inf)
HISTOGRAMS = frozenset({"job_run_seconds", "job_wait_seconds"})
COMPACT_BATCH = 20_000
COMPACT_MAX_BATCHES_PER_SCRAPE = 5



# --- the write path -------------------------------------------------------------------------

def labels_key(labels: dict[str, Any]) -> str:
    """The canonical text of a label set (the ``labels`` column)."""
    return json.dumps({key: "" if value is None else str(value) for key, value in labels.items()},
                      sort_keys=True, separators=(",", ":"))


def bucket_of(value: float) -> str:
    """The ``le`` label of the smallest bucket holding ``value``."""
    for bound in BUCKETS:
        if value <= bound:
            return floatToGoString(bound)
    return "+Inf"


def metric_sample(name: str, **labels: Any) -> MetricDelta:
    """One increment of counter ``name`` (not saved: pass it to ``metrics_add``)."""
    return MetricDelta(name=name, labels=labels_key(labels), count=1, total=0.0)


def metric_observation(name: str, value: float, **labels: Any) -> MetricDelta:
    """One observation of histogram ``name`` (not saved: pass it to ``metrics_add``)."""
    value = max(0.0, float(value))
    return MetricDelta(name=name, labels=labels_key({**labels, "le": bucket_of(value)}), count=1, total=value)


def metrics_add(samples: Iterable[MetricDelta]) -> None:
    """Insert samples in the caller's transaction: they count only if it commits. One prepared
    statement on PostgreSQL (``insert_tree``), not one the ORM compiles per call: 0.2 ms less of
    an enqueue's CPU (``jobs_enqueue_many`` of 15 jobs: 5.4 against 5.6 ms, 4.5 against 4.7)."""
    samples = list(samples)
    if samples:
        insert_tree([(samples, None)])


# --- folding ---------------------------------------------------------------------------------

_COMPACT_POSTGRES = """
WITH moved AS (
    DELETE FROM {delta} WHERE id IN (
        SELECT id FROM {delta} ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)
    RETURNING name, labels, count, total
), folded AS (
    INSERT INTO {total} (name, labels, count, total)
    SELECT name, labels, SUM(count), SUM(total) FROM moved GROUP BY name, labels ORDER BY name, labels
    ON CONFLICT (name, labels) DO UPDATE
        SET count = {total}.count + EXCLUDED.count, total = {total}.total + EXCLUDED.total
    RETURNING 1
)
SELECT (SELECT COUNT(*) FROM moved), (SELECT COUNT(*) FROM folded)
"""

_FOLD_SQLITE = """
INSERT INTO {total} (name, labels, count, total)
SELECT name, labels, SUM(count), SUM(total) FROM {delta} WHERE id <= %s GROUP BY name, labels ORDER BY name, labels
ON CONFLICT (name, labels) DO UPDATE SET count = count + excluded.count, total = total + excluded.total
"""


def metric_tables() -> dict[str, str]:
    return {"delta": connection.ops.quote_name(MetricDelta._meta.db_table),
            "total": connection.ops.quote_name(MetricTotal._meta.db_table)}


def _compact_batch(batch: int) -> int:
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # Concurrent folds take disjoint rows (SKIP LOCKED); a row is deleted and added once.
            cursor.execute(_COMPACT_POSTGRES.format(**metric_tables()), [batch])
            return int(cursor.fetchone()[0])
        # SQLite: one writer at a time, so read the range, fold it and delete it.
        cursor.execute(f"SELECT MAX(id), COUNT(*) FROM (SELECT id FROM {metric_tables()['delta']} ORDER BY id LIMIT %s)",
                       [batch])
        upto, moved = cursor.fetchone()
        if not moved:
            return 0
        cursor.execute(_FOLD_SQLITE.format(**metric_tables()), [upto])
        cursor.execute(f"DELETE FROM {metric_tables()['delta']} WHERE id <= %s", [upto])
        return int(moved)


def metrics_compact(*, batch: int = COMPACT_BATCH, max_batches: int | None = None) -> int:
    """Run the apps' roll-ups (``COMPACTORS``: they may add samples), then fold pending
    ``MetricDelta`` rows into ``MetricTotal`` in batches; returns rows rolled up and folded."""
    rolled = sum(compact() for compact in COMPACTORS)
    folded = 0
    batches = 0
    while max_batches is None or batches < max_batches:
        moved = _compact_batch(batch)
        folded += moved
        batches += 1
        if moved < batch:
            break
    return folded + rolled


# --- series derived from the tables ----------------------------------------------------------

KEY_COLUMNS = 7
VALUE_COLUMNS = 5


@dataclass(frozen=True)
class Derived:
    """Counters an app derives from its own tables at scrape time.

    ``sql()`` returns ``(sql, params)`` of a query whose columns are named ``k1``…``k<keys>``
    (text, at most ``KEY_COLUMNS``) and ``v1``…``v<values>`` (numbers, at most ``VALUE_COLUMNS``);
    ``series(keys, values)``
    turns one of its rows into ``(name, labels, count, total)`` tuples (a histogram observation's
    labels carry its ``le``, as ``metric_observation`` writes them).
    """

    name: str
    keys: int
    values: int
    sql: Callable[[], tuple[str, list]]
    series: Callable[[tuple, tuple], Iterable[tuple[str, dict[str, Any], float, float]]]


DERIVED: list[Derived] = []

# Bucket bounds in whole microseconds: a duration of ``us`` microseconds is in bucket ``le`` when
# ``us <= bound``, exactly as ``bucket_of(us / 1e6)`` decides (both are exact at the bounds).
BUCKET_BOUNDS_US = tuple(int(round(bound * 1_000_000)) for bound in BUCKETS if not math.isinf(bound))
BUCKET_LABELS = tuple(floatToGoString(bound) for bound in BUCKETS)  # by bucket index; the last is +Inf


def bucket_sql(micros: str) -> str:
    """SQL: the index in ``BUCKET_LABELS`` of the bucket of a duration in microseconds (NULL stays
    NULL). ``micros`` should be a plain column (the expression repeats it)."""
    if connection.vendor == "postgresql":
        # The number of bounds below ``us`` (``us`` and the bounds are whole microseconds).
        bounds = ",".join(str(bound) for bound in BUCKET_BOUNDS_US)
        return f"width_bucket({micros} - 1, ARRAY[{bounds}]::bigint[])"
    whens = " ".join(f"WHEN {micros} <= {bound} THEN {index}" for index, bound in enumerate(BUCKET_BOUNDS_US))
    return f"CASE WHEN {micros} IS NULL THEN NULL {whens} ELSE {len(BUCKET_BOUNDS_US)} END"


def bucket_label(index) -> str | None:
    """The ``le`` label of a bucket index read back from ``bucket_sql`` (None: no observation)."""
    return None if index is None else BUCKET_LABELS[int(index)]


def micros_between_sql(start: str, end: str) -> str:
    """SQL: whole microseconds from datetime ``start`` to ``end`` (exact, on both databases).

    Run it with a parameter list (even an empty one): the ``%%`` is a literal ``%`` then."""
    if connection.vendor == "postgresql":
        # An interval's epoch as a double is exact to the microsecond for any span under 285 years.
        return f"round(date_part('epoch', {end} - {start}) * 1000000)::bigint"

    def micros(column):  # SQLite keeps 'YYYY-MM-DD HH:MM:SS[.ffffff]' (UTC): seconds, then the fraction.
        # The seconds from the first 19 characters only: strftime reads a fraction to the millisecond
        # and rounds, so '...:01.9996' would count as second 2 (a duration one second off).
        return (f"(CAST(strftime('%%s', substr({column}, 1, 19)) AS INTEGER) * 1000000 + CASE WHEN length({column}) > 19 "
                f"THEN CAST(substr({column} || '000000', 21, 6) AS INTEGER) ELSE 0 END)")

    return f"({micros(end)} - {micros(start)})"


def fence_sql() -> str:
    """What ends a subquery so the planner computes its columns once per row instead of inlining
    them into the outer query (PostgreSQL ``OFFSET 0``, SQLite ``LIMIT -1``)."""
    return " OFFSET 0" if connection.vendor == "postgresql" else " LIMIT -1"


def micros_between(start, end) -> int:
    """Whole microseconds from ``start`` to ``end`` (what ``micros_between_sql`` gives)."""
    return (end - start) // timedelta(microseconds=1)


MICROS_PREFIX = "_us:"


def micros_series(histogram: str) -> str:
    """The hidden series that keeps a derived histogram's sum in whole microseconds (in ``count``,
    exact): moving rows from the tables to the base never changes it by a rounding, so the
    exposed ``_sum`` never goes down."""
    return MICROS_PREFIX + histogram


class Tally:
    """Series counts gathered in Python (the rows a delete removes), keyed like the base."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, str], list] = {}

    def add(self, name: str, labels: dict[str, Any], count: float = 1, total: float = 0.0) -> None:
        entry = self.series.setdefault((name, labels_key(labels)), [0, 0.0])
        entry[0] += count
        entry[1] += total

    def observe_micros(self, name: str, micros: int, **labels: Any) -> None:
        """One observation of histogram ``name``: its bucket counts one, and its sum adds whole
        microseconds (``micros_series``)."""
        micros = max(0, micros)
        self.add(name, {**labels, "le": bucket_of(micros / 1_000_000)}, 1)
        self.add(micros_series(name), labels, micros)

    def rows(self, sign: int = 1) -> list[MetricDelta]:
        return [MetricDelta(name=name, labels=labels, count=sign * int(count), total=sign * float(total))
                for (name, labels), (count, total) in sorted(self.series.items()) if count or total]


def metrics_fold(tally: Tally, *, sign: int = 1) -> None:
    """Add what deleted rows counted to the base, in the caller's (the delete's) transaction."""
    metrics_add(tally.rows(sign))


# --- reading ---------------------------------------------------------------------------------

def _series_sql() -> tuple[str, list]:
    tables = metric_tables()
    # Every column has one type in every branch (PostgreSQL matches the branches' types).
    key = lambda i, expression="NULL": f"CAST({expression} AS TEXT) AS k{i}"  # noqa: E731
    number = lambda i, expression="NULL": f"CAST({expression} AS NUMERIC) AS v{i}"  # noqa: E731
    base = ", ".join(["0 AS src", key(1, "name"), key(2, "labels"), *(key(i) for i in range(3, KEY_COLUMNS + 1)),
                      number(1, "SUM(count)"), number(2, "SUM(total)"),
                      *(number(i) for i in range(3, VALUE_COLUMNS + 1))])
    parts = [f"SELECT * FROM (SELECT {base} FROM (SELECT name, labels, count, total FROM {tables['total']} "
             f"UNION ALL SELECT name, labels, count, total FROM {tables['delta']}) AS stored "
             f"GROUP BY name, labels) AS base"]
    params: list = []
    for index, source in enumerate(DERIVED, start=1):
        sql, source_params = source.sql()
        columns = [f"{index} AS src"]
        columns += [key(i, f"d.k{i}") if i <= source.keys else key(i) for i in range(1, KEY_COLUMNS + 1)]
        columns += [number(i, f"d.v{i}") if i <= source.values else number(i) for i in range(1, VALUE_COLUMNS + 1)]
        parts.append(f"SELECT {', '.join(columns)} FROM ({sql}) AS d")
        params += source_params
    return " UNION ALL ".join(parts), params


def metric_series() -> dict[tuple[str, str], tuple[int, float]]:
    """Every series' ``(count, total)``: the base (totals plus pending rows) plus what the tables
    count now, read in one statement (one snapshot)."""
    sql, params = _series_sql()
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    width = 1 + KEY_COLUMNS
    series: dict[tuple[str, str], list] = {}

    def add(key, count, total):
        entry = series.setdefault(key, [0, 0.0])
        entry[0] += int(count or 0)
        entry[1] += float(total or 0.0)

    for row in rows:
        src, keys, values = row[0], row[1:width], row[width:]
        if src == 0:
            add((keys[0], keys[1]), values[0], values[1])
            continue
        for name, labels, count, total in DERIVED[src - 1].series(keys, values):
            add((name, labels_key(labels)), count, total)
    for (name, labels_text), (micros, _) in list(series.items()):
        if name.startswith(MICROS_PREFIX):  # a histogram's sum in microseconds: its +Inf bucket's total
            labels = {**json.loads(labels_text), "le": "+Inf"}
            entry = series.setdefault((name[len(MICROS_PREFIX):], labels_key(labels)), [0, 0.0])
            entry[1] += micros / 1_000_000
    return {key: (count, total) for key, (count, total) in series.items() if not key[0].startswith("_")}


@dataclass(frozen=True)
class Family:
    name: str
    documentation: str
    labels: tuple[str, ...]


COUNTERS: dict[str, Family] = {
    "jobs_enqueued": Family("orchestrator_jobs_enqueued", "Jobs enqueued, by type.", ("type",)),
    "job_dedupe_hits": Family("orchestrator_job_dedupe_hits",
                              "Enqueues answered by an existing active job (dedupe), by type and outcome "
                              "(already_queued, dropped, merged).", ("type", "outcome")),
    "job_attempts": Family("orchestrator_job_attempts", "Job attempts started (claims), by type.", ("type",)),
    "job_retries": Family("orchestrator_job_retries", "Job attempts after the first (retries and recoveries), "
                                                      "by type.", ("type",)),
    "runs_finished": Family("orchestrator_runs_finished", "Runs that reached completed, failed or cancelled, by "
                                                          "state and reason (the error code of a failure).",
                            ("state", "reason")),
}
FINISHED = {
    "completed": Family("orchestrator_job_completions", "Jobs completed, by type and reason "
                                                        "(completed, deadline_fallback).", ("type", "reason")),
    "failed": Family("orchestrator_job_failures", "Jobs failed, by type and reason code.", ("type", "reason")),
    "cancelled": Family("orchestrator_job_cancels", "Jobs cancelled, by type and reason "
                                                    "(cancelled, interrupt_timeout).", ("type", "reason")),
}
HISTOGRAM_FAMILIES = {
    "job_run_seconds": Family("orchestrator_job_run_seconds",
                              "Job run latency: first start to terminal state, by type and final state.",
                              ("type", "state")),
    "job_wait_seconds": Family("orchestrator_job_wait_seconds",
                               "Job wait: queued to first start, by type and priority class "
                               "(the aged background wait is priority=\"background\").", ("type", "priority")),
}


# The metric families of the apps above core: ``collect(now)`` functions yielding metric families,
# registered by each app in its ``AppConfig.ready`` (billing: credits and the ledger; jobs: queue
# depth and wait, workers; runs: runs by state, stuck runs, escalations, invariants).
COLLECTORS: list[Callable[[datetime], Iterable]] = []
# Folds an app does at scrape time besides the pending samples (billing: the ledger roll-up);
# each returns how many rows it folded.
COMPACTORS: list[Callable[[], int]] = []


class OrchestratorCollector:
    """A ``prometheus_client`` collector: every scrape reads the database afresh."""

    def collect(self) -> Iterator:
        now = timezone.now()
        yield from self._queue_counters()
        yield from self._relay(now)
        for collect in COLLECTORS:
            yield from collect(now)

    def _queue_counters(self) -> Iterator:
        series = metric_series()
        counters = {key: CounterMetricFamily(f.name, f.documentation, labels=f.labels) for key, f in COUNTERS.items()}
        finished = {key: CounterMetricFamily(f.name, f.documentation, labels=f.labels) for key, f in FINISHED.items()}
        histograms: dict[str, dict[tuple, dict[str, Any]]] = {key: {} for key in HISTOGRAM_FAMILIES}
        for (name, labels_text), (count, total) in sorted(series.items()):
            labels = json.loads(labels_text)
            if name in counters:
                family = COUNTERS[name]
                counters[name].add_metric([labels.get(label, "") for label in family.labels], count)
            elif name == "job_finished" and labels.get("state") in finished:
                family = FINISHED[labels["state"]]
                finished[labels["state"]].add_metric([labels.get(label, "") for label in family.labels], count)
            elif name in histograms:
                family = HISTOGRAM_FAMILIES[name]
                key = tuple(labels.get(label, "") for label in family.labels)
                series_data = histograms[name].setdefault(key, {"buckets": {}, "sum": 0.0})
                series_data["buckets"][labels.get("le", "+Inf")] = \
                    series_data["buckets"].get(labels.get("le", "+Inf"), 0) + count
                series_data["sum"] += total
        yield from counters.values()
        yield from finished.values()
        for name, by_labels in histograms.items():
            family = HISTOGRAM_FAMILIES[name]
            metric = HistogramMetricFamily(family.name, family.documentation, labels=family.labels)
            for key, data in by_labels.items():
                cumulative = 0
                buckets = []
                for bound in BUCKETS:
                    label = floatToGoString(bound)
                    cumulative += data["buckets"].get(label, 0)
                    buckets.append((label, cumulative))
                metric.add_metric(list(key), buckets, data["sum"])
            yield metric

    def _relay(self, now) -> Iterator:
        from core.relay import relay_status

        state = relay_status()
        yield GaugeMetricFamily("orchestrator_relay_running",
                                "1 when an event relay runs in the process that answered this scrape.",
                                value=0 if state is None else 1)
        # Declared (without a sample) when no relay runs here, so alert rules can name them.
        lag = GaugeMetricFamily("orchestrator_relay_lag_events",
                                "Committed events this process's relay has not delivered yet.")
        age = GaugeMetricFamily("orchestrator_relay_oldest_unrelayed_seconds",
                                "Age of the oldest event this process's relay has not delivered (0: none).")
        if state is not None:
            lag.add_metric([], state["lag"])
            oldest = (Event.objects.filter(id__gt=state["cursor"]).order_by("id")
                      .values_list("created_at", flat=True).first())
            age.add_metric([], 0.0 if oldest is None else max(0.0, (now - oldest).total_seconds()))
        yield lag
        yield age

# --- the endpoint ------------------------------------------------------------------------------

def metrics_text() -> bytes:
    """The exposition text of every metric (folds pending samples first, best effort)."""
    try:
        metrics_compact(max_batches=COMPACT_MAX_BATCHES_PER_SCRAPE)
    except DatabaseError:
        # Another fold holds the rows, or the database refuses writes: read what is there.
        logger.warning("metrics: could not fold pending samples before the scrape", exc_info=True)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(OrchestratorCollector())
    return generate_latest(registry)


def _bearer_token(request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def metrics_access(request) -> tuple[int, str, str, dict] | None:
    """None when the request may read the metrics, else ``(status, code, detail, extra fields)``.

    A wrong token counts as a failed authentication of the client's address, as on the API;
    once the address has spent its allowance, a token is refused (429) without being compared.
    """
    token = _bearer_token(request)
    expected = settings.ORCHESTRATOR_METRICS_TOKEN
    if token is not None:
        address = client_address(request.META)
        refusal = auth_failures_refusal(address)
        if refusal is not None:
            return 429, "rate_limited", (f"too many failed authentications from this address; try again in "
                                         f"{retry_after_text(refusal.retry_after_s)}"), {
                "retry_after": refusal.retry_after_s}
        if expected and hmac.compare_digest(token.encode(), expected.encode()):
            return None
        auth_failure_record(address)
        return 401, "authentication_failed", "the metrics token is wrong (or ORCHESTRATOR_METRICS_TOKEN is not set)", {}
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return 401, "not_authenticated", "send Authorization: Bearer <ORCHESTRATOR_METRICS_TOKEN> or sign in as staff", {}
    if not (user.is_active and user.is_staff):
        return 403, "permission_denied", "only staff users may read the metrics", {}
    return None


def metrics_view(request):
    """``GET /metrics``: the Prometheus text exposition (token or staff session)."""
    refused = metrics_access(request)
    if refused is not None:
        status, code, detail, extra = refused
        response = JsonResponse({"code": code, "detail": detail, **extra}, status=status)
        if status == 401:
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        if status == 429:
            response["Retry-After"] = str(extra["retry_after"])
        return response
    if request.method not in ("GET", "HEAD"):
        response = JsonResponse({"code": "method_not_allowed", "detail": f"{request.method} is not allowed"},
                                status=405)
        response["Allow"] = "GET, HEAD"
        return response
    try:
        body = metrics_text()
    except DatabaseError as exc:
        logger.exception("metrics: the database could not be read")
        return JsonResponse({"code": "unavailable", "detail": f"the database could not be read ({type(exc).__name__})"},
                            status=503)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
