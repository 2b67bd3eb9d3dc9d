"""The cost of an idle console: CPU seconds and SQL statements per minute with nothing to do.

Starts ``manage.py run_console`` (daphne and a ``qcluster`` of ``--workers`` worker processes) on a
scratch database, lets it settle, then measures for ``--seconds``:

* the CPU time (user + system, from ``/proc/<pid>/stat``) of the whole process tree;
* the SQL statements and transactions every process ran (``bench.counting``'s counting cursors,
  summed in Redis), and on PostgreSQL the server's own ``xact_commit + xact_rollback`` of the
  database (``pg_stat_database``).

Both are printed per minute. Examples::

    .venv/bin/python bench/idle.py --sqlite
    BENCH_DATABASE_PREFIX=orch_bm BENCH_REDIS_URL=redis://127.0.0.1:6379/5 .venv/bin/python bench/idle.py

``--seconds`` defaults to 60 and ``--settle`` (seconds before measuring) to 20.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# bench/ holds a queue.py: keep it off the import path so the standard library's ``queue`` is found.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

from bench._common import django_setup, scratch_database, start_process, stop_process  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def tree_cpu_ticks(root: int) -> dict[int, int]:
    """``{pid: utime + stime}`` of ``root`` and every descendant alive now."""
    tree = _children()
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(tree.get(pid, []))
    ticks = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks


def pg_transactions() -> int | None:
    from django.db import connection

    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sqlite", action="store_true", help="SQLite and the ORM broker (default: PostgreSQL + Redis)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()

    redis_url = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/5")
    env = scratch_database("sqlite" if args.sqlite else "postgres", "orchestrator_bench_idle")
    django_setup()
    import redis

    from bench import counting

    client = redis.Redis.from_url(redis_url)
    client.delete(counting.STATEMENTS, counting.TRANSACTIONS)
    child_env = {**env, "DJANGO_SETTINGS_MODULE": "bench.settings", "BENCH_COUNT_URL": redis_url,
                 "ORCHESTRATOR_Q_WORKERS": str(args.workers), "ORCHESTRATOR_TRANSITION_LOG_LEVEL": "WARNING"}
    if not args.sqlite:
        child_env["REDIS_URL"] = redis_url
    log = Path(tempfile.mkdtemp(prefix="orchestrator-idle-")) / "console.log"
    console = start_process([sys.executable, "manage.py", "run_console", "--port", str(args.port)], child_env, log)
    try:
        time.sleep(args.settle)
        if console.poll() is not None:
            print(log.read_text()[-3000:])
            return 1
        start_ticks = tree_cpu_ticks(console.pid)
        start_counts = counting.flushed_counts(redis_url)
        start_xacts = pg_transactions()
        started = time.monotonic()
        time.sleep(args.seconds)
        time.sleep(2 * counting.FLUSH_INTERVAL_S)  # the last flush of the window's counts
        end_ticks = tree_cpu_ticks(console.pid)
        end_counts = counting.flushed_counts(redis_url)
        end_xacts = pg_transactions()
        elapsed = time.monotonic() - started
    finally:
        stop_process(console)
    # Processes alive at both ends (a process born in the window counts from zero).
    ticks = sum(end - start_ticks.get(pid, 0) for pid, end in end_ticks.items())
    per_minute = 60.0 / elapsed
    kind = "SQLite + ORM broker" if args.sqlite else "PostgreSQL + Redis"
    print(f"idle console ({kind}, daphne + qcluster of {args.workers} workers, {len(end_ticks)} processes), "
          f"{elapsed:.1f} s measured after {args.settle:.0f} s:")
    print(f"  CPU              {ticks / TICKS * per_minute:8.2f} s per minute "
          f"({100 * ticks / TICKS / elapsed:.2f} % of one core)")
    print(f"  SQL statements   {(end_counts['statements'] - start_counts['statements']) * per_minute:8.1f} per minute")
    print(f"  transactions     {(end_counts['transactions'] - start_counts['transactions']) * per_minute:8.1f} "
          f"per minute (client side)")
    if start_xacts is not None:
        # Includes this script's own two reads of pg_stat_database.
        print(f"  server xacts     {(end_xacts - start_xacts) * per_minute:8.1f} per minute (pg_stat_database)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
