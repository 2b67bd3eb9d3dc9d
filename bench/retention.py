"""Benchmark: the retention prune keeps the hot tables (jobs, events) bounded under the demo's load.

    .venv/bin/python bench/retention.py [--days 7] [--interval 3] [--jobs-per-run 8] [--events-per-run 20]
                                        [--retention-days 2]

Simulates ``--days`` of the demo's steady load (``demo_stream`` starts one run a beat, a beat every
``--interval`` seconds, 3 by default: 28,800 runs a day) in a scratch database (PostgreSQL when
``DATABASE_URL`` names a server: ``<its database>_bench_retention``; else a SQLite file): settled
runs, each with ``--jobs-per-run`` terminal jobs and ``--events-per-run`` events, their timestamps
spread evenly over the period in id order (older rows, lower ids, as under real load), made by
the server (``generate_series``). It then prints the row
count and on-disk size of the jobs and events tables before and after ``retention_prune`` (with
``ORCHESTRATOR_RETENTION_DAYS=--retention-days``): what is left is the retention window's share of
the load, whatever the period simulated. The per-run figures are options because they depend on
the plans the demo draws; the defaults are a typical demo research run's.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH_DIR]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from urllib.parse import urlsplit, urlunsplit  # noqa: E402


def prepare_database() -> str:
    url = os.environ.get("DATABASE_URL", "").strip()
    if url.startswith(("postgres://", "postgresql://")):
        import psycopg

        parts = urlsplit(url)
        name = f"{parts.path.lstrip('/') or 'orchestrator'}_bench_retention"
        with psycopg.connect(urlunsplit(parts._replace(path="/postgres", query="")), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
        os.environ["DATABASE_URL"] = urlunsplit(parts._replace(path=f"/{name}"))
        return f"PostgreSQL (database {name})"
    os.environ.pop("DATABASE_URL", None)
    path = Path(tempfile.mkdtemp(prefix="orchestrator-retention-")) / "bench.sqlite3"
    os.environ["ORCHESTRATOR_SQLITE_PATH"] = str(path)
    return f"SQLite (file {path})"


def table_sizes() -> dict[str, tuple[int, int | None]]:
    from django.db import connection

    sizes = {}
    for table in ("jobs_job", "core_event"):
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT COUNT(*) FROM {table}")
            rows = cursor.fetchone()[0]
            size = None
            if connection.vendor == "postgresql":
                cursor.execute("SELECT pg_total_relation_size(%s)", [table])
                size = cursor.fetchone()[0]
        sizes[table] = (rows, size)
    return sizes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between demo beats (one run each)")
    parser.add_argument("--jobs-per-run", type=int, default=8)
    parser.add_argument("--events-per-run", type=int, default=20)
    parser.add_argument("--retention-days", type=int, default=2)
    args = parser.parse_args()
    if args.days <= 0 or args.interval <= 0 or args.jobs_per_run < 0 or args.events_per_run < 0 \
            or args.retention_days < 1:
        parser.error("--days and --interval must be positive, --retention-days at least 1")
    os.environ["DJANGO_SETTINGS_MODULE"] = "orchestrator_site.settings"
    os.environ["ORCHESTRATOR_RETENTION_DAYS"] = str(args.retention_days)
    os.environ.setdefault("ORCHESTRATOR_TRANSITION_LOG_LEVEL", "WARNING")
    label = prepare_database()

    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection, transaction
    from django.utils import timezone

    from bench.admin_seed import series_insert
    from billing.services import organization_create
    from core.models import Event
    from console.retention import retention_prune
    from jobs.models import Job
    from runs.models import Run

    call_command("migrate", verbosity=0)
    if connection.vendor != "postgresql":
        raise SystemExit("this bench seeds with generate_series: set DATABASE_URL=postgres://...")
    organization, project, _, _ = organization_create(name="retention-bench", owner_username="retention-bench",
                                                      credits=10**9)
    runs = int(args.days * 86400 / args.interval)
    period_s = int(args.days * 86400)
    now = timezone.now()
    started = time.perf_counter()
    with transaction.atomic():
        series_insert(Run, {
            "organization_id": str(organization.pk), "project_id": str(project.pk), "name": "'demo run ' || s.g",
            "plan": "'{}'::jsonb", "status": "'completed'", "credit_limit": "100", "credits_reserved": "10",
            "credits_charged": "5", "credits_refunded": "5", "created_at": "s.t", "status_changed_at": "s.t",
            "completed_at": "s.t",
        }, "(SELECT g, %s::timestamptz - make_interval(secs => ((%s - 1 - g)::bigint * %s) / %s) AS t "
           "FROM generate_series(0, %s - 1) AS g) AS s", [], now, source_params=[now, runs, period_s, runs, runs])
        series_insert(Job, {
            "type": "'run_step'", "organization_id": "r.organization_id", "project_id": "r.project_id",
            "run_id": "r.id", "state": "'completed'", "reason": "'completed'", "lane": "''", "payload": "'{}'::jsonb",
            "attempts": "1", "created_at": "r.created_at", "queued_at": "r.created_at", "started_at": "r.created_at",
            "completed_at": "r.created_at",
        }, "runs_run AS r CROSS JOIN generate_series(1, %s) AS n ORDER BY r.id", [], now,
           source_params=[args.jobs_per_run])
        series_insert(Event, {
            "type": "'step_completed'", "organization_id": "r.organization_id", "project_id": "r.project_id",
            "run_id": "r.id", "payload": "'{}'::jsonb", "created_at": "r.created_at",
        }, "runs_run AS r CROSS JOIN generate_series(1, %s) AS n ORDER BY r.id", [], now,
           source_params=[args.events_per_run])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    print(f"database: {label}; {args.days:g} days of the demo's load: {runs:,} runs (one every {args.interval:g} s), "
          f"{args.jobs_per_run} jobs and {args.events_per_run} events each; seeded in "
          f"{time.perf_counter() - started:.1f} s; retention {args.retention_days} days")
    before = table_sizes()
    started = time.perf_counter()
    results = retention_prune(now=now)
    pruned_in = time.perf_counter() - started
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    after = table_sizes()
    print(f"\n{'table':12} {'rows before':>12} {'rows after':>11} {'MiB before':>11} {'MiB after':>10}")
    for table in before:
        (rows_before, size_before), (rows_after, size_after) = before[table], after[table]
        print(f"{table:12} {rows_before:12,} {rows_after:11,} {size_before / 2**20:11.1f} {size_after / 2**20:10.1f}")
    expected = args.retention_days / args.days
    print(f"\nprune: {', '.join(f'{r.name} {r.done:,}' for r in results if r.done)} in {pruned_in:.1f} s; "
          f"kept {after['jobs_job'][0] / max(1, before['jobs_job'][0]):.0%} of jobs and "
          f"{after['core_event'][0] / max(1, before['core_event'][0]):.0%} of events "
          f"(the retention window is {min(1, expected):.0%} of the period; the table's disk space is reused by "
          "new rows after autovacuum, not returned to the system)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
