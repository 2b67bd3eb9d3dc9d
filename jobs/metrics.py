"""The jobs app's part of ``/metrics``: queue depth and wait by project and type, jobs executing,
the aged background jobs, and the workers' liveness; and the queue's counters.

``jobs_collect`` is registered in ``core.metrics.COLLECTORS`` and ``JOB_COUNTERS`` (attempts,
retries, finished jobs, run and wait time: ``jobs.counters``) in ``core.metrics.DERIVED``
(``JobsConfig.ready``); both read the job and heartbeat tables at scrape time, so every process
answers the same figures.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Iterator

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, Min, Q
from prometheus_client.core import GaugeMetricFamily

from core.metrics import metrics_fold
from jobs.counters import TALLY_FIELDS, job_counter_source, job_tally
from jobs.models import ACTIVE_JOB_STATES, TERMINAL_JOB_STATES, WAITING_JOB_STATES, Job, JobState, WorkerHeartbeat

# Waiting as the queue caps count it (every state before executing), and claimable (queued or
# awaiting a tool: claimed once ``not_before`` has passed).
WAITING_STATES = tuple(sorted(ACTIVE_JOB_STATES - {JobState.EXECUTING}))
CLAIMABLE_STATES = tuple(sorted(WAITING_JOB_STATES))
WORKERS_LISTED = 50
JOB_COUNTERS = job_counter_source(Job._meta.db_table, TERMINAL_JOB_STATES)
ROLLUP_BATCH = 1_000
ROLLUP_MAX_BATCHES = 50
# One call stops after this long (a scrape stays fast while a big backlog is rolled up over many
# scrapes and prunes; what is not rolled up yet is derived from the table meanwhile).
ROLLUP_MAX_S = 0.25


def _rollup_batch(batch: int) -> int:
    q = connection.ops.quote_name
    table = q(Job._meta.db_table)
    terminal = sorted(TERMINAL_JOB_STATES)
    marks = ", ".join(["%s"] * len(terminal))
    fields = ", ".join(f"{table}.{q(name)}" for name in TALLY_FIELDS)
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # Concurrent roll-ups (and deletes) take disjoint rows: each job moves to the base once.
            cursor.execute(
                f"WITH picked AS (SELECT {q('id')} FROM {table} WHERE NOT {q('counted')} AND {q('state')} IN ({marks}) "
                f"ORDER BY {q('id')} LIMIT %s FOR UPDATE SKIP LOCKED) "
                f"UPDATE {table} SET {q('counted')} = true FROM picked WHERE {table}.{q('id')} = picked.{q('id')} "
                f"RETURNING {fields}", [*terminal, batch])
            rows = cursor.fetchall()
        else:  # SQLite: one writer at a time (IMMEDIATE transactions)
            ids = list(Job.objects.filter(counted=False, state__in=terminal).order_by("id")
                       .values_list("id", flat=True)[:batch])
            rows = list(Job.objects.filter(pk__in=ids).values_list(*TALLY_FIELDS))
            Job.objects.filter(pk__in=ids).update(counted=True)
        metrics_fold(job_tally(rows, TERMINAL_JOB_STATES))
        return len(rows)


def job_counters_rollup(*, batch: int | None = None, max_batches: int | None = None) -> int:
    """Move the counts of terminal jobs (final: a terminal job never changes) from the job table to
    the metrics base, marking them ``counted``, so a scrape derives its counters from the live and
    recently finished jobs only (``job_uncounted_idx``). Registered in ``core.metrics.COMPACTORS``:
    every scrape and prune runs it. Returns how many jobs it moved."""
    batch = batch or ROLLUP_BATCH
    deadline = time.monotonic() + ROLLUP_MAX_S
    moved = 0
    for _ in range(ROLLUP_MAX_BATCHES if max_batches is None else max_batches):
        done = _rollup_batch(batch)
        moved += done
        if done < batch or time.monotonic() >= deadline:
            break
    return moved


def jobs_collect(now: datetime) -> Iterator:
    yield from _queue_gauges(now)
    yield from _workers(now)


def _queue_gauges(now) -> Iterator:
    aging = now - timedelta(milliseconds=settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS)
    rows = (Job.objects.filter(state__in=[*WAITING_STATES, "executing"])
            .values("project_id", "type").annotate(
                waiting=Count("id", filter=Q(state__in=WAITING_STATES)),
                executing=Count("id", filter=Q(state="executing")),
                aged=Count("id", filter=Q(state__in=CLAIMABLE_STATES, priority_class="background",
                                          queued_at__lte=aging)),
                oldest_background=Min("queued_at", filter=Q(state__in=CLAIMABLE_STATES,
                                                            priority_class="background")),
                oldest_claimable=Min("queued_at", filter=Q(state__in=CLAIMABLE_STATES)),
            ).order_by())
    depth = 0
    by_project: dict[int, int] = {}
    by_type: dict[str, int] = {}
    executing: dict[str, int] = {}
    aged = 0
    oldest = None
    oldest_claimable = None
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
        if row["oldest_claimable"] is not None and (oldest_claimable is None
                                                    or row["oldest_claimable"] < oldest_claimable):
            oldest_claimable = row["oldest_claimable"]
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
    yield GaugeMetricFamily("orchestrator_queue_oldest_wait_seconds",
                            "How long the oldest claimable job (queued or awaiting a tool) has waited "
                            "since it was queued (0: none waits).",
                            value=0.0 if oldest_claimable is None
                            else max(0.0, (now - oldest_claimable).total_seconds()))
    yield GaugeMetricFamily("orchestrator_background_aged_jobs",
                            "Background jobs waiting longer than ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS.",
                            value=aged)
    yield GaugeMetricFamily("orchestrator_background_oldest_wait_seconds",
                            "How long the oldest waiting background job has waited (0: none waits).",
                            value=0.0 if oldest is None else max(0.0, (now - oldest).total_seconds()))


def _workers(now) -> Iterator:
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
