"""The cost of a ``/metrics`` scrape over a big job table (PostgreSQL).

Seeds ``--jobs`` jobs (default 100,000: 85 % completed, 8 % failed, 5 % cancelled, 2 % queued; 1 to
3 attempts; run and wait times spread over every histogram bucket) with ``generate_series``,
ANALYZEs, times the first scrape (which, where finished jobs are rolled up into the metrics base,
rolls them up), then times ``core.metrics.metrics_text`` (the whole exposition, as ``/metrics``
answers it) ``--repeat`` times and prints the median; where the counters are derived from the job table
(``core.metrics.DERIVED``) it also times their one statement alone and prints its plan
(``EXPLAIN ANALYZE``). Example::

    BENCH_DATABASE_PREFIX=orch_bm .venv/bin/python bench/scrape.py --jobs 100000
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# bench/ holds a queue.py: keep it off the import path so the standard library's ``queue`` is found.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from bench._common import django_setup, scratch_database  # noqa: E402

TYPES = ("noop", "probe", "run_step", "run_tick")


def seed(jobs: int) -> None:
    from django.db import connection, transaction
    from django.utils import timezone

    from bench.admin_seed import series_insert
    from billing.services import organization_create
    from core.models import Project
    from jobs.models import Job

    organization_create(name="scrape", owner_username="scrape-owner", credits=0)
    project = Project.objects.order_by("id").first()
    now = timezone.now()
    types = "ARRAY[" + ",".join(f"'{job_type}'" for job_type in TYPES) + "]"
    state = ("CASE WHEN g % 100 < 85 THEN 'completed' WHEN g % 100 < 93 THEN 'failed' "
             "WHEN g % 100 < 98 THEN 'cancelled' ELSE 'queued' END")
    source = (f"(SELECT g, {state} AS state, %s::timestamptz - make_interval(secs => g % 86400) AS queued, "
              f"(g * 7919 % 100000) / 1000.0 AS wait_s, (g * 104729 % 1000000) / 1000.0 AS run_s "
              f"FROM generate_series(1::bigint, %s) AS g) AS s")
    started = "CASE WHEN s.state = 'queued' THEN NULL ELSE s.queued + make_interval(secs => s.wait_s) END"
    with transaction.atomic():
        series_insert(Job, {
            "type": f"({types})[1 + s.g % {len(TYPES)}]", "organization_id": str(project.organization_id),
            "project_id": str(project.pk), "state": "s.state",
            "reason": ("CASE s.state WHEN 'completed' THEN 'completed' WHEN 'failed' THEN 'fatal_error' "
                       "WHEN 'cancelled' THEN 'cancelled' ELSE '' END"),
            "priority_class": "CASE WHEN s.g % 10 = 0 THEN 'interactive' ELSE 'background' END",
            "class_rank": "CASE WHEN s.g % 10 = 0 THEN 0 ELSE 1 END",
            "attempts": "CASE WHEN s.state = 'queued' THEN 0 ELSE 1 + s.g % 3 END",
            "payload": "'{}'::jsonb", "queued_at": "s.queued", "created_at": "s.queued", "started_at": started,
            "completed_at": f"CASE WHEN s.state = 'queued' THEN NULL ELSE {started} + make_interval(secs => s.run_s) END",
        }, source, [], now, source_params=[now, jobs])
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    scratch_database("postgres", "orchestrator_bench_scrape")
    django_setup()
    from django.db import connection

    import core.metrics as metrics

    started = time.perf_counter()
    seed(args.jobs)
    print(f"seeded {args.jobs:,} jobs in {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    metrics.metrics_text()  # the first scrape: folds pending samples (and rolls finished jobs up, where it does)
    print(f"first scrape: {(time.perf_counter() - started) * 1000:.0f} ms")
    started, rounds = time.perf_counter(), 0
    while metrics.metrics_compact():  # what the next scrapes (or a prune) do until nothing is left to roll up
        rounds += 1
    print(f"rolled up and folded the rest in {rounds} more rounds, {time.perf_counter() - started:.1f} s")
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE")  # what autovacuum does after a big roll-up
    times = []
    for _ in range(args.repeat):
        started = time.perf_counter()
        body = metrics.metrics_text()
        times.append(time.perf_counter() - started)
    print(f"/metrics exposition ({len(body):,} bytes): median {statistics.median(times) * 1000:.1f} ms, "
          f"min {min(times) * 1000:.1f} ms over {args.repeat}")
    if getattr(metrics, "DERIVED", None):
        sql, params = metrics._series_sql()
        times = []
        with connection.cursor() as cursor:
            for _ in range(args.repeat):
                started = time.perf_counter()
                cursor.execute(sql, params)
                cursor.fetchall()
                times.append(time.perf_counter() - started)
            print(f"the counters' one statement: median {statistics.median(times) * 1000:.1f} ms")
            cursor.execute("EXPLAIN (ANALYZE, COSTS OFF) " + sql, params)
            print("\n".join(row[0] for row in cursor.fetchall()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
