"""Prometheus metrics at ``/metrics``, computed from the database when scraped.

Every figure comes from the database, so any process (several daphne behind a load balancer,
any number of ``qcluster`` workers) answers the same numbers; nothing is counted in process
memory. Three sources:

* **Counters and histograms of the queue** (enqueues, dedupe hits, attempts, retries,
  completions, failures and cancels by type and reason, run and wait time) are ``MetricDelta``
  rows inserted by the job services in the transaction of the change they count (a rolled-back
  change counts nothing). The write path only inserts, so no two transactions wait for each
  other on a counter row; ``metrics_compact`` folds the rows into ``MetricTotal`` in batches
  (on every scrape and every prune), and a scrape reads totals and pending rows in one
  statement, so a concurrent fold is never counted twice or missed.
* **Ledger entries by kind** are rolled up from the append-only ledger itself: entries up to a
  watermark are folded into ``MetricTotal``; the rest are counted live. The watermark only moves
  past entries older than ``LEDGER_SETTLE``, so an entry that commits late is still counted
  (a transaction would have to stay open that long to be missed).
* **Gauges** (queue depth globally, per project and per type, executing jobs, aged background
  jobs, runs by state, credits reserved, workers alive) are grouped queries over live rows.
  Relay lag is the lag of the relays running in the process that answers the scrape.

Access: ``Authorization: Bearer <ORCHESTRATOR_METRICS_TOKEN>``, or a staff session.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Iterator

from django.apps import apps
from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import Count, F, Max, Min, Q, Sum
from django.http import HttpResponse, JsonResponse
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from core.models import Event, MetricDelta, MetricTotal
from core.ratelimit import auth_failure_record, auth_failures_refusal, client_address, retry_after_text

logger = logging.getLogger("orchestrator.metrics")

# Seconds; a job's run time (started → terminal) and wait (queued → first start).
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0, math.inf)
HISTOGRAMS = frozenset({"job_run_seconds", "job_wait_seconds"})
COMPACT_BATCH = 20_000
COMPACT_MAX_BATCHES_PER_SCRAPE = 5
LEDGER_SETTLE = timedelta(minutes=5)
LEDGER_SERIES = "ledger_entries"
LEDGER_WATERMARK = "_ledger_watermark"
WORKERS_LISTED = 50

# Waiting jobs as the queue caps count them (``jobs.services.enqueue._waiting_depth``).
WAITING_STATES = ("received", "queued", "awaiting_tool", "awaiting_user_confirmation")
CLAIMABLE_STATES = ("queued", "awaiting_tool")


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
    """Insert samples in the caller's transaction: they count only if it commits."""
    samples = list(samples)
    if samples:
        MetricDelta.objects.bulk_create(samples)


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


def _tables() -> dict[str, str]:
    return {"delta": connection.ops.quote_name(MetricDelta._meta.db_table),
            "total": connection.ops.quote_name(MetricTotal._meta.db_table)}


def _compact_batch(batch: int) -> int:
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # Concurrent folds take disjoint rows (SKIP LOCKED); a row is deleted and added once.
            cursor.execute(_COMPACT_POSTGRES.format(**_tables()), [batch])
            return int(cursor.fetchone()[0])
        # SQLite: one writer at a time, so read the range, fold it and delete it.
        cursor.execute(f"SELECT MAX(id), COUNT(*) FROM (SELECT id FROM {_tables()['delta']} ORDER BY id LIMIT %s)",
                       [batch])
        upto, moved = cursor.fetchone()
        if not moved:
            return 0
        cursor.execute(_FOLD_SQLITE.format(**_tables()), [upto])
        cursor.execute(f"DELETE FROM {_tables()['delta']} WHERE id <= %s", [upto])
        return int(moved)


def metrics_compact(*, batch: int = COMPACT_BATCH, max_batches: int | None = None) -> int:
    """Fold pending ``MetricDelta`` rows into ``MetricTotal`` in batches; returns rows folded."""
    folded = 0
    batches = 0
    while max_batches is None or batches < max_batches:
        moved = _compact_batch(batch)
        folded += moved
        batches += 1
        if moved < batch:
            break
    folded_ledger = ledger_rollup()
    return folded + folded_ledger


def ledger_rollup(*, now=None) -> int:
    """Fold ledger entries older than ``LEDGER_SETTLE`` past the watermark into the totals."""
    LedgerEntry = apps.get_model("billing", "LedgerEntry")
    now = now or timezone.now()
    with transaction.atomic():
        MetricTotal.objects.get_or_create(name=LEDGER_WATERMARK, labels="{}")
        mark = MetricTotal.objects.select_for_update().get(name=LEDGER_WATERMARK, labels="{}")
        upto = (LedgerEntry.objects.filter(id__gt=mark.count, created_at__lt=now - LEDGER_SETTLE)
                .aggregate(m=Max("id"))["m"])
        if upto is None:
            return 0
        rows = (LedgerEntry.objects.filter(id__gt=mark.count, id__lte=upto).values("kind")
                .annotate(n=Count("id"), amount=Sum("amount")).order_by("kind"))
        folded = 0
        for row in rows:
            total, _ = MetricTotal.objects.get_or_create(name=LEDGER_SERIES, labels=labels_key({"kind": row["kind"]}))
            MetricTotal.objects.filter(pk=total.pk).update(count=F("count") + row["n"],
                                                           total=F("total") + float(row["amount"] or 0))
            folded += row["n"]
        MetricTotal.objects.filter(pk=mark.pk).update(count=upto)
        return folded


# --- reading ---------------------------------------------------------------------------------

def metric_series() -> dict[tuple[str, str], tuple[int, float]]:
    """Every series' ``(count, total)``: totals plus pending rows, read in one statement."""
    tables = _tables()
    sql = (f"SELECT name, labels, SUM(count), SUM(total) FROM ("
           f"SELECT name, labels, count, total FROM {tables['total']} WHERE name <> %s "
           f"UNION ALL SELECT name, labels, count, total FROM {tables['delta']}) AS series "
           f"GROUP BY name, labels")
    with connection.cursor() as cursor:
        cursor.execute(sql, [LEDGER_WATERMARK])
        rows = cursor.fetchall()
    return {(name, labels): (int(count or 0), float(total or 0.0)) for name, labels, count, total in rows
            if not name.startswith("_")}


def ledger_series() -> dict[str, tuple[int, int]]:
    """Ledger entries and credits by kind: the rolled-up totals plus entries past the watermark."""
    LedgerEntry = apps.get_model("billing", "LedgerEntry")
    ledger = connection.ops.quote_name(LedgerEntry._meta.db_table)
    total = _tables()["total"]
    sql = (f"SELECT labels, SUM(n), SUM(amount) FROM ("
           f"SELECT labels, count AS n, total AS amount FROM {total} WHERE name = %s "
           f"UNION ALL SELECT '{{\"kind\":\"' || kind || '\"}}' AS labels, COUNT(*) AS n, "
           f"CAST(SUM(amount) AS DOUBLE PRECISION) AS amount FROM {ledger} "
           f"WHERE id > COALESCE((SELECT MAX(count) FROM {total} WHERE name = %s), 0) GROUP BY kind"
           f") AS entries GROUP BY labels")
    with connection.cursor() as cursor:
        cursor.execute(sql, [LEDGER_SERIES, LEDGER_WATERMARK])
        rows = cursor.fetchall()
    result = {}
    for labels, count, amount in rows:
        kind = json.loads(labels).get("kind", "")
        result[kind] = (int(count or 0), int(round(float(amount or 0))))
    return result


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


class OrchestratorCollector:
    """A ``prometheus_client`` collector: every scrape reads the database afresh."""

    def collect(self) -> Iterator:
        now = timezone.now()
        yield from self._queue_counters()
        yield from self._queue_gauges(now)
        yield from self._runs()
        yield from self._credits()
        yield from self._relay(now)
        yield from self._workers(now)

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
        ledger = ledger_series()
        entries = CounterMetricFamily("orchestrator_ledger_entries", "Credit ledger entries, by kind.",
                                      labels=("kind",))
        credits = CounterMetricFamily("orchestrator_ledger_credits", "Credits moved by ledger entries, by kind.",
                                      labels=("kind",))
        for kind, (count, amount) in sorted(ledger.items()):
            entries.add_metric([kind], count)
            credits.add_metric([kind], amount)
        yield entries
        yield credits

    def _queue_gauges(self, now) -> Iterator:
        Job = apps.get_model("jobs", "Job")
        aging = now - timedelta(milliseconds=settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS)
        rows = (Job.objects.filter(state__in=[*WAITING_STATES, "executing"])
                .values("project_id", "type").annotate(
                    waiting=Count("id", filter=Q(state__in=WAITING_STATES)),
                    executing=Count("id", filter=Q(state="executing")),
                    aged=Count("id", filter=Q(state__in=CLAIMABLE_STATES, priority_class="background",
                                              queued_at__lte=aging)),
                    oldest_background=Min("queued_at", filter=Q(state__in=CLAIMABLE_STATES,
                                                                priority_class="background")),
                ).order_by())
        depth = 0
        by_project: dict[int, int] = {}
        by_type: dict[str, int] = {}
        executing: dict[str, int] = {}
        aged = 0
        oldest = None
        for row in rows:
            depth += row["waiting"]
            if row["waiting"]:
                by_project[row["project_id"]] = by_project.get(row["project_id"], 0) + row["waiting"]
                by_type[row["type"]] = by_type.get(row["type"], 0) + row["waiting"]
            if row["executing"]:
                executing[row["type"]] = executing.get(row["type"], 0) + row["executing"]
            aged += row["aged"]
            if row["oldest_background"] is not None and (oldest is None or row["oldest_background"] < oldest):
                oldest = row["oldest_background"]
        yield GaugeMetricFamily("orchestrator_queue_depth", "Jobs waiting in all projects (as the queue caps "
                                                            "count them).", value=depth)
        project_gauge = GaugeMetricFamily("orchestrator_project_queue_depth", "Jobs waiting, per project "
                                                                              "(projects with waiting jobs).",
                                          labels=("project",))
        for project_id, count in sorted(by_project.items()):
            project_gauge.add_metric([str(project_id)], count)
        yield project_gauge
        type_gauge = GaugeMetricFamily("orchestrator_queue_depth_by_type", "Jobs waiting, per type.",
                                       labels=("type",))
        for job_type, count in sorted(by_type.items()):
            type_gauge.add_metric([job_type], count)
        yield type_gauge
        executing_gauge = GaugeMetricFamily("orchestrator_jobs_executing", "Jobs executing, per type.",
                                            labels=("type",))
        for job_type, count in sorted(executing.items()):
            executing_gauge.add_metric([job_type], count)
        yield executing_gauge
        yield GaugeMetricFamily("orchestrator_background_aged_jobs",
                                "Background jobs waiting longer than ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS.",
                                value=aged)
        yield GaugeMetricFamily("orchestrator_background_oldest_wait_seconds",
                                "How long the oldest waiting background job has waited (0: none waits).",
                                value=0.0 if oldest is None else max(0.0, (now - oldest).total_seconds()))

    def _runs(self) -> Iterator:
        Run = apps.get_model("runs", "Run")
        counts = dict(Run.objects.filter(deleted_at__isnull=True).values_list("status")
                      .annotate(n=Count("id")).order_by())
        gauge = GaugeMetricFamily("orchestrator_runs", "Runs, by state.", labels=("state",))
        for state in Run.Status.values:
            gauge.add_metric([state], counts.get(state, 0))
        yield gauge

    def _credits(self) -> Iterator:
        CreditAccount = apps.get_model("billing", "CreditAccount")
        total = CreditAccount.objects.aggregate(reserved=Sum("reserved"))["reserved"] or 0
        yield GaugeMetricFamily("orchestrator_credits_reserved", "Credits reserved for runs, in all organizations.",
                                value=total)
        by_organization = GaugeMetricFamily("orchestrator_organization_credits_reserved",
                                            "Credits reserved for runs, per organization (those holding some).",
                                            labels=("organization",))
        for organization_id, reserved in (CreditAccount.objects.filter(reserved__gt=0)
                                          .values_list("organization_id", "reserved").order_by("organization_id")):
            by_organization.add_metric([str(organization_id)], reserved)
        yield by_organization

    def _relay(self, now) -> Iterator:
        from core.relay import relay_status

        state = relay_status()
        yield GaugeMetricFamily("orchestrator_relay_running",
                                "1 when an event relay runs in the process that answered this scrape.",
                                value=0 if state is None else 1)
        if state is None:
            return
        yield GaugeMetricFamily("orchestrator_relay_lag_events",
                                "Committed events this process's relay has not delivered yet.", value=state["lag"])
        oldest = (Event.objects.filter(id__gt=state["cursor"]).order_by("id")
                  .values_list("created_at", flat=True).first())
        yield GaugeMetricFamily("orchestrator_relay_oldest_unrelayed_seconds",
                                "Age of the oldest event this process's relay has not delivered (0: none).",
                                value=0.0 if oldest is None else max(0.0, (now - oldest).total_seconds()))

    def _workers(self, now) -> Iterator:
        WorkerHeartbeat = apps.get_model("jobs", "WorkerHeartbeat")
        window = settings.ORCHESTRATOR_QUEUE_LEASE_S
        alive_since = now - timedelta(seconds=window)
        seen = WorkerHeartbeat.objects.aggregate(alive=Count("worker", filter=Q(last_seen__gte=alive_since)),
                                                 total=Count("worker"))
        yield GaugeMetricFamily("orchestrator_workers_alive",
                                "Worker processes with a heartbeat younger than ORCHESTRATOR_QUEUE_LEASE_S.",
                                value=seen["alive"])
        yield GaugeMetricFamily("orchestrator_workers_stale", "Worker processes seen before but not alive now.",
                                value=seen["total"] - seen["alive"])
        ages = GaugeMetricFamily("orchestrator_worker_heartbeat_age_seconds",
                                 f"Seconds since each of the {WORKERS_LISTED} most recently seen worker processes "
                                 f"sent a heartbeat.", labels=("worker", "cluster"))
        for worker, cluster, last_seen in (WorkerHeartbeat.objects.order_by("-last_seen")
                                           .values_list("worker", "cluster", "last_seen")[:WORKERS_LISTED]):
            ages.add_metric([worker, cluster], max(0.0, (now - last_seen).total_seconds()))
        yield ages


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
