"""The queue's counters, derived from the job table (no write per transition).

A job row carries everything its transitions counted: ``attempts`` (each claim adds one, so
``attempts - 1`` of them were retries or recoveries), its final state and reason once terminal
(terminal states never change), ``started_at`` (the first start, kept across retries) and
``completed_at``, ``queued_at``. So at scrape time:

=====================  ==========================================================================
job_attempts           the sum of ``attempts``, by type
job_retries            the sum of ``attempts - 1`` over jobs started more than once, by type
job_finished           terminal jobs, by type, state and reason
job_run_seconds        ``completed_at - started_at`` of terminal jobs that started, by type, state
job_wait_seconds       ``started_at - queued_at`` (or ``created_at``) of jobs that started, by type
                       and priority class
=====================  ==========================================================================

``job_counter_source`` is the SQL of all five in one pass over the jobs not ``counted`` yet;
``job_tally`` computes the same figures in Python for rows that leave that set: terminal jobs the
roll-up marks ``counted`` (``jobs.metrics.job_counters_rollup``, run by every scrape and prune:
the scrape reads only recent and live jobs), and uncounted rows ``JobQuerySet.delete`` removes;
either adds them to the metrics base in its own transaction (``core.metrics.metrics_fold``).
Both measure durations in whole microseconds, so a duration on a bucket bound lands in the same
bucket either way.
"""

from __future__ import annotations

from typing import Any, Iterable

from django.db import connection

from core.metrics import (Derived, Tally, bucket_label, bucket_sql, fence_sql, micros_between, micros_between_sql,
                          micros_series)

# The columns ``job_tally`` reads, in order.
TALLY_FIELDS = ("type", "state", "reason", "priority_class", "attempts", "started_at", "completed_at", "queued_at",
                "created_at")


def job_tally(rows: Iterable[tuple], terminal_states: Iterable[str]) -> Tally:
    """What ``rows`` (``TALLY_FIELDS`` tuples) count in the derived job counters."""
    terminal = frozenset(terminal_states)
    tally = Tally()
    for job_type, state, reason, priority, attempts, started_at, completed_at, queued_at, created_at in rows:
        if attempts > 0:
            tally.add("job_attempts", {"type": job_type}, attempts)
            if started_at is not None:
                tally.observe_micros("job_wait_seconds", micros_between(queued_at or created_at, started_at),
                                     type=job_type, priority=priority)
        if attempts > 1:
            tally.add("job_retries", {"type": job_type}, attempts - 1)
        if state in terminal:
            tally.add("job_finished", {"type": job_type, "state": state, "reason": reason})
            if started_at is not None and completed_at is not None:
                tally.observe_micros("job_run_seconds", micros_between(started_at, completed_at), type=job_type,
                                     state=state)
    return tally


def job_counter_sql(table: str, terminal_states: Iterable[str]) -> tuple[str, list]:
    """One grouped pass over the job table (``Derived.sql`` of ``job_counter_source``): each row's
    run and wait time computed once (a fenced subquery), grouped by type, state, reason, priority
    class and the two buckets (a few hundred groups, whatever the number of jobs)."""
    terminal = sorted(terminal_states)
    marks = ", ".join(["%s"] * len(terminal))
    q = connection.ops.quote_name
    run_us = micros_between_sql(q("started_at"), q("completed_at"))
    wait_us = micros_between_sql(f"COALESCE({q('queued_at')}, {q('created_at')})", q("started_at"))
    rows = (f"SELECT {q('type')} AS type, {q('state')} AS state, {q('reason')} AS reason, "
            f"{q('priority_class')} AS priority, {q('attempts')} AS attempts, "
            f"CASE WHEN {q('state')} IN ({marks}) AND {q('started_at')} IS NOT NULL "
            f"AND {q('completed_at')} IS NOT NULL THEN {run_us} END AS run_us, "
            f"CASE WHEN {q('attempts')} > 0 AND {q('started_at')} IS NOT NULL THEN {wait_us} END AS wait_us "
            f"FROM {q(table)} WHERE NOT {q('counted')} AND ({q('attempts')} > 0 OR {q('state')} IN ({marks}))"
            f"{fence_sql()}")
    sql = (f"SELECT type AS k1, state AS k2, reason AS k3, priority AS k4, "
           f"{bucket_sql('run_us')} AS k5, {bucket_sql('wait_us')} AS k6, "
           f"COUNT(*) AS v1, SUM(attempts) AS v2, SUM(CASE WHEN attempts > 1 THEN attempts - 1 ELSE 0 END) AS v3, "
           f"SUM(CASE WHEN run_us > 0 THEN run_us ELSE 0 END) AS v4, "
           f"SUM(CASE WHEN wait_us > 0 THEN wait_us ELSE 0 END) AS v5 "
           f"FROM ({rows}) AS jobs GROUP BY 1, 2, 3, 4, 5, 6")
    return sql, [*terminal, *terminal]


def job_counter_series(terminal_states: Iterable[str]):
    terminal = frozenset(terminal_states)

    def series(keys: tuple, values: tuple) -> Iterable[tuple[str, dict[str, Any], float, float]]:
        job_type, state, reason, priority = keys[:4]
        run_le, wait_le = bucket_label(keys[4]), bucket_label(keys[5])
        count, attempts, retries, run_us, wait_us = (value or 0 for value in values[:5])
        if attempts:
            yield "job_attempts", {"type": job_type}, attempts, 0.0
        if retries:
            yield "job_retries", {"type": job_type}, retries, 0.0
        if state in terminal:
            yield "job_finished", {"type": job_type, "state": state, "reason": reason}, count, 0.0
        if run_le is not None:
            yield "job_run_seconds", {"type": job_type, "state": state, "le": run_le}, count, 0.0
            yield micros_series("job_run_seconds"), {"type": job_type, "state": state}, run_us, 0.0
        if wait_le is not None:
            yield "job_wait_seconds", {"type": job_type, "priority": priority, "le": wait_le}, count, 0.0
            yield micros_series("job_wait_seconds"), {"type": job_type, "priority": priority}, wait_us, 0.0

    return series


def job_counter_source(table: str, terminal_states: Iterable[str]) -> Derived:
    """The ``core.metrics.DERIVED`` source of the job counters (``JobsConfig.ready`` registers it)."""
    terminal = tuple(sorted(terminal_states))
    return Derived(name="jobs", keys=6, values=5, sql=lambda: job_counter_sql(table, terminal),
                   series=job_counter_series(terminal))
