"""Benchmark: full run lifecycles per second, next to a bare row-lock baseline.

    .venv/bin/python bench/transitions.py [--runs N] [--baseline N]

A lifecycle is what one small run costs the database: ``run_create`` → ``run_start`` (reserve)
→ ``run_mark_running`` (spawn 1 agent, 1 task, 1 step) → ``step_begin`` +
``step_attempt_succeed`` (charge, complete the step, task, agent and the run, settle the
reservation), with every ledger entry, event and row lock the services write. The baseline is
the cheapest useful transaction on the same connection: ``SELECT ... FOR UPDATE`` + ``UPDATE``
of one row of a scratch table (like pgbench's single-row lock-and-update).

The database is the configured engine (SQLite by default, PostgreSQL when ``DATABASE_URL`` is
set) but never the configured database: SQLite uses a temporary file, PostgreSQL a scratch
database ``orchestrator_bench_transitions`` on the same server, created before and dropped
after. Run dispatchers are detached so that no worker is asked to execute the benchmark's runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Running ``bench/transitions.py`` puts ``bench/`` first on sys.path, where ``bench/queue.py``
# would shadow the standard library's ``queue``: take the directory off, put the project on.
BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH_DIR]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402
from urllib.parse import urlsplit, urlunsplit  # noqa: E402

# Its own scratch database (bench/queue.py uses ``orchestrator_bench``; both may run at once).
# ``BENCH_DATABASE_PREFIX`` replaces its ``orchestrator_bench`` prefix (as in bench/_common.py).
BENCH_DATABASE = (os.environ.get("BENCH_DATABASE_PREFIX", "").strip() or "orchestrator_bench") + "_transitions"


def _postgres_urls(url: str) -> tuple[str, str]:
    """The scratch database's URL and the server's maintenance database URL."""
    parts = urlsplit(url)
    bench = urlunsplit(parts._replace(path=f"/{BENCH_DATABASE}"))
    maintenance = urlunsplit(parts._replace(path="/postgres", query=""))
    return bench, maintenance


def _postgres_recreate(maintenance_url: str, *, drop_only: bool = False) -> None:
    import psycopg

    with psycopg.connect(maintenance_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{BENCH_DATABASE}" WITH (FORCE)')
        if not drop_only:
            conn.execute(f'CREATE DATABASE "{BENCH_DATABASE}"')


def prepare_environment() -> tuple[str, Callable[[], None]]:
    """Point the settings at a scratch database; return its label and a cleanup function."""
    url = os.environ.get("DATABASE_URL", "").strip()
    if url.startswith(("postgres://", "postgresql://", "pgsql://")):
        if urlsplit(url).path.lstrip("/") == BENCH_DATABASE:
            raise SystemExit(f"DATABASE_URL names {BENCH_DATABASE}, the benchmark's scratch database: refusing")
        bench_url, maintenance_url = _postgres_urls(url)
        _postgres_recreate(maintenance_url)
        os.environ["DATABASE_URL"] = bench_url

        def cleanup() -> None:
            from django.db import connections

            connections.close_all()
            _postgres_recreate(maintenance_url, drop_only=True)

        return f"PostgreSQL (scratch database {BENCH_DATABASE})", cleanup
    os.environ.pop("DATABASE_URL", None)
    scratch = Path(tempfile.mkdtemp(prefix="orchestrator-bench-"))
    os.environ["ORCHESTRATOR_SQLITE_PATH"] = str(scratch / "bench.sqlite3")

    def cleanup() -> None:
        from django.db import connections

        connections.close_all()
        shutil.rmtree(scratch, ignore_errors=True)

    return f"SQLite (scratch file {scratch / 'bench.sqlite3'})", cleanup


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300, help="run lifecycles to time (default 300)")
    parser.add_argument("--baseline", type=int, default=3000, help="baseline transactions to time (default 3000)")
    parser.add_argument("--show-queries", action="store_true", help="print the statements of one lifecycle, by phase")
    args = parser.parse_args()
    if args.runs < 1 or args.baseline < 1:
        parser.error("--runs and --baseline must be at least 1")

    os.environ["DJANGO_SETTINGS_MODULE"] = "orchestrator_site.settings"
    os.environ.setdefault("ORCHESTRATOR_TRANSITION_LOG_LEVEL", "WARNING")  # figures, not a log line per transition
    label, cleanup = prepare_environment()
    try:
        return run_benchmark(label, runs=args.runs, baseline=args.baseline, show_queries=args.show_queries)
    finally:
        cleanup()


def run_benchmark(label: str, *, runs: int, baseline: int, show_queries: bool = False) -> int:
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from billing.services import organization_create
    from runs import services
    from runs.invariants import invariants_check
    from runs.models import Run

    call_command("migrate", verbosity=0, interactive=False)
    services.RUN_DISPATCHERS.clear()  # no worker may pick up the benchmark's runs
    _, project, _, _ = organization_create(name="bench", owner_username="bench", credits=10**12)
    plan = {"agents": [{"name": "a", "tasks": [{"name": "t", "steps": [
        {"name": "s", "tool": "echo", "args": {"text": "bench"}}]}]}]}

    phases = ["run_create", "run_start", "run_mark_running", "step_begin", "step_attempt_succeed"]

    def lifecycle(counts: dict | None = None) -> None:
        marks = []

        def mark() -> None:
            if counts is not None:
                marks.append(len(connection.queries))

        mark()
        run = services.run_create(project=project, name="bench", plan=plan)
        mark()
        services.run_start(run_id=run.pk)
        mark()
        services.run_mark_running(run_id=run.pk)
        mark()
        step = services.runnable_steps(Run.objects.get(pk=run.pk))[0]
        attempt = services.step_begin(step_id=step.pk)
        mark()
        outcome = services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True})
        mark()
        if outcome.decision != "completed":
            raise RuntimeError(f"unexpected step outcome {outcome}")
        if counts is not None:
            for name, start, end in zip(phases, marks, marks[1:]):
                counts[name] = counts.get(name, 0) + end - start
                if show_queries and len(counts) <= len(phases) and counts[name] == end - start:
                    print(f"-- {name}: {end - start} statements")
                    for query in connection.queries[start:end]:
                        print(f"   {query['sql'][:400]}")

    # Warm up (connections, prepared statements, caches), then count queries on a sample.
    for _ in range(10):
        lifecycle()
    sample = 20
    counts: dict[str, int] = {}
    with CaptureQueriesContext(connection) as captured:
        for _ in range(sample):
            lifecycle(counts)
    queries_per_lifecycle = sum(counts.values()) / sample
    savepoints_per_lifecycle = sum(
        1 for query in captured.captured_queries
        if query["sql"].lstrip().upper().startswith(("SAVEPOINT", "RELEASE SAVEPOINT", "ROLLBACK TO SAVEPOINT"))
    ) / sample

    started = time.perf_counter()
    for _ in range(runs):
        lifecycle()
    lifecycle_seconds = time.perf_counter() - started

    completed = Run.objects.filter(status=Run.Status.COMPLETED).count()
    expected = runs + sample + 10
    violations = invariants_check()

    # Baseline: one row, lock then update, one transaction each, same connection and settings.
    lock_clause = " FOR UPDATE" if connection.features.has_select_for_update else ""
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE bench_counter (id integer PRIMARY KEY, value bigint NOT NULL)")
        cursor.execute("INSERT INTO bench_counter (id, value) VALUES (1, 0)")
    select_sql = f"SELECT value FROM bench_counter WHERE id = 1{lock_clause}"
    update_sql = "UPDATE bench_counter SET value = value + 1 WHERE id = 1"

    def baseline_transaction() -> None:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(select_sql)
            cursor.fetchone()
            cursor.execute(update_sql)

    for _ in range(100):
        baseline_transaction()
    started = time.perf_counter()
    for _ in range(baseline):
        baseline_transaction()
    baseline_seconds = time.perf_counter() - started

    lifecycle_rate = runs / lifecycle_seconds
    baseline_rate = baseline / baseline_seconds
    transitions_rate = lifecycle_rate * len(phases)
    database = connection.settings_dict
    print(f"database            : {label}, {connection.vendor} {_server_version(connection)}")
    print(f"connection          : CONN_MAX_AGE={database.get('CONN_MAX_AGE')}, "
          f"options={ {k: v for k, v in (database.get('OPTIONS') or {}).items() if k != 'init_command'} }")
    print(f"durability          : {_durability(connection)}")
    print(f"plan                : 1 agent, 1 task, 1 step (echo); {len(phases)} service transactions per lifecycle")
    print(f"lifecycles          : {runs} in {lifecycle_seconds:.2f} s = {lifecycle_rate:,.1f} lifecycles/s "
          f"({transitions_rate:,.0f} service transactions/s, {1000 / lifecycle_rate:.2f} ms per lifecycle)")
    print(f"baseline            : {baseline} x (SELECT{lock_clause} + UPDATE) in {baseline_seconds:.2f} s "
          f"= {baseline_rate:,.1f} transactions/s")
    print(f"ratio               : baseline / lifecycles = {baseline_rate / lifecycle_rate:.1f}x "
          f"(per service transaction {baseline_rate / transitions_rate:.1f}x)")
    print(f"queries / lifecycle : {queries_per_lifecycle:.1f}, of which {savepoints_per_lifecycle:.1f} savepoint "
          f"statements ({', '.join(f'{name} {count / sample:.1f}' for name, count in counts.items())})")
    print(f"check               : {completed}/{expected} runs completed, invariant violations: {len(violations)}")
    for violation in violations[:5]:
        print(f"  {violation}")
    return 0 if completed == expected and not violations else 1


def _durability(connection) -> str:
    """The settings that decide what a commit costs (a flush to disk or not)."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            values = []
            for name in ("synchronous_commit", "fsync", "wal_sync_method"):
                cursor.execute(f"SHOW {name}")
                values.append(f"{name}={cursor.fetchone()[0]}")
            return ", ".join(values)
        if connection.vendor == "sqlite":
            cursor.execute("PRAGMA journal_mode")
            journal = cursor.fetchone()[0]
            cursor.execute("PRAGMA synchronous")
            synchronous = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}.get(cursor.fetchone()[0], "?")
            return f"journal_mode={journal}, synchronous={synchronous}"
    return ""


def _server_version(connection) -> str:
    if connection.vendor == "postgresql":
        version = connection.pg_version
        return f"{version // 10000}.{version % 10000}"
    if connection.vendor == "sqlite":
        import sqlite3

        return sqlite3.sqlite_version
    return ""


if __name__ == "__main__":
    sys.exit(main())
