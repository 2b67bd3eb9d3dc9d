"""Shared set-up for benchmarks: a scratch database, migrations, processes, percentiles."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BASE_DIR))


# The baselines' clusters run django-q2 as it ships: a worker replaced after 500 tasks, all at the
# same count, no memory bound (our settings raise the count and spread it per process), and no
# statements of ours at a worker's start (its claim planned ahead).
BARE_DJANGO_Q = {"ORCHESTRATOR_Q_RECYCLE": "500", "ORCHESTRATOR_Q_RECYCLE_SPREAD": "0",
                 "ORCHESTRATOR_Q_MAX_RSS_KB": "0", "ORCHESTRATOR_QUEUE_WARM_AT_START": "false"}


def scratch_name(name: str) -> str:
    """``name`` with its ``orchestrator_bench`` prefix replaced by ``BENCH_DATABASE_PREFIX`` (if set)."""
    prefix = os.environ.get("BENCH_DATABASE_PREFIX", "").strip()
    if prefix and name.startswith("orchestrator_bench"):
        return prefix + name[len("orchestrator_bench"):]
    return name


def scratch_database(kind: str, name: str = "orchestrator_bench") -> dict[str, str]:
    """Point this process (and children) at an empty database of ``kind`` (sqlite|postgres)."""
    env: dict[str, str] = {}
    name = scratch_name(name)
    if kind == "postgres":
        import psycopg

        base = os.environ.get("BENCH_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/postgres")
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
        env["DATABASE_URL"] = base.rsplit("/", 1)[0] + f"/{name}"
        os.environ.pop("ORCHESTRATOR_SQLITE_PATH", None)
    else:
        directory = Path(tempfile.mkdtemp(prefix="orchestrator-bench-"))
        env["ORCHESTRATOR_SQLITE_PATH"] = str(directory / "bench.sqlite3")
        os.environ.pop("DATABASE_URL", None)
    os.environ.update(env)
    os.environ["DJANGO_SETTINGS_MODULE"] = "orchestrator_site.settings"
    # A benchmark prints figures, not one log line per transition (its children inherit this).
    os.environ.setdefault("ORCHESTRATOR_TRANSITION_LOG_LEVEL", "WARNING")
    return env


def broker_env(env: dict[str, str], *, sqlite: bool, redis_url: str) -> None:
    """Complete ``env`` with the broker of the benchmark's processes (the ORM broker on SQLite, whose
    rate limits then live in the database too; Redis at ``redis_url`` otherwise) and apply it here."""
    if sqlite:
        os.environ.pop("REDIS_URL", None)
        env["ORCHESTRATOR_RATE_LIMIT_STORE"] = "database"
    else:
        env["REDIS_URL"] = redis_url
    os.environ.update(env)


def django_setup() -> None:
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def start_process(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A child process in its own session, with this environment plus ``env``, output to ``log``."""
    return subprocess.Popen(argv, cwd=BASE_DIR, env={**os.environ, **env}, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def start_cluster(env: dict[str, str], log: Path) -> subprocess.Popen:
    return start_process([sys.executable, "manage.py", "qcluster"], env, log)


def _signalled(process: subprocess.Popen, signum: int, grace_s: float) -> bool:
    """Send ``signum`` to the process if it still runs and give it ``grace_s`` to end: has it ended?"""
    if process.poll() is None:
        process.send_signal(signum)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        return False
    return True


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM, up to 30 s, then SIGKILL to its whole session (children included); reaped."""
    _signalled(process, signal.SIGTERM, 30)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(10)


stop_cluster = stop_process


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def wait_until(predicate, timeout: float, interval: float = 0.05) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(interval)
    raise TimeoutError("benchmark did not finish in time")


def cleanup(path: str | None) -> None:
    if path:
        shutil.rmtree(Path(path).parent, ignore_errors=True)


# --- what the database did: transactions and statements over a window --------------------------

def postgres_counters(database_url: str) -> dict[str, int]:
    """This database's ``pg_stat_database`` counters, plus ``pg_stat_statements`` calls if loaded.

    The server publishes a backend's counts at the end of its transactions at most once a second
    (and when it exits), so a window read while workers run is exact within a second's worth.
    """
    import psycopg

    name = database_url.rsplit("/", 1)[1].split("?")[0]
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit, xact_rollback, tup_returned, tup_fetched, tup_inserted, tup_updated, tup_deleted "
            "FROM pg_stat_database WHERE datname = %s", (name,)).fetchone()
        counters = dict(zip(("xact_commit", "xact_rollback", "tup_returned", "tup_fetched", "tup_inserted",
                             "tup_updated", "tup_deleted"), row))
        if pg_stat_statements_ready(conn):
            counters["pgss_calls"] = conn.execute(
                "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
                "WHERE d.datname = %s", (name,)).fetchone()[0]
    return counters


_PGSS: dict[str, object] = {}


def pg_stat_statements_ready(conn) -> bool:
    """Create ``pg_stat_statements`` in this database if the server preloads it; else False."""
    if "ready" not in _PGSS:
        preload = conn.execute("SHOW shared_preload_libraries").fetchone()[0]
        ready = "pg_stat_statements" in preload
        if ready:
            try:
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            except Exception as exc:  # no permission: fall back like an unloaded one
                _PGSS["why"] = f"CREATE EXTENSION failed: {exc}"
                ready = False
        else:
            _PGSS["why"] = ("pg_stat_statements is not in shared_preload_libraries "
                            f"({preload or 'empty'}): statements counted by the processes' own cursors")
        _PGSS["ready"] = ready
    return bool(_PGSS["ready"])


def pg_stat_statements_note() -> str:
    return "" if _PGSS.get("ready") else str(_PGSS.get("why", ""))


def counters_delta(before: dict, after: dict) -> dict:
    return {key: after[key] - before.get(key, 0) for key in after}


def wait_workers(count: int, since, timeout: float = 120, cluster: str | None = None) -> None:
    """Until ``count`` worker processes (of the django-q2 cluster named ``cluster``, if given) have
    written a heartbeat since ``since`` (they are up)."""
    from django.db import connection

    from jobs.models import WorkerHeartbeat

    beats = WorkerHeartbeat.objects.filter(last_seen__gte=since)
    if cluster is not None:
        beats = beats.filter(cluster=cluster)
    wait_until(lambda: beats.count() >= count, timeout, 0.2)
    connection.close()


# --- py-spy ---------------------------------------------------------------------------------------

def start_profile(pid: int, out: Path, rate: int = 50) -> subprocess.Popen:
    """``py-spy record`` of process ``pid`` and its children, collapsed stacks (idle included)."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not installed: .venv/bin/pip install -e '.[bench]'")
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--subprocesses", "--idle", "--nonblocking",
                             "--nolineno", "--rate", str(rate), "--format", "raw", "--output", str(out)],
                            stdout=open(out.with_suffix(".log"), "w"), stderr=subprocess.STDOUT)


def stop_profile(process: subprocess.Popen) -> None:
    """Stop recording (SIGINT makes py-spy write its file)."""
    if not _signalled(process, signal.SIGINT, 60):
        process.kill()
        process.wait(10)


class Window:
    """Transactions and statements of the scratch database between ``open()`` and ``close()``.

    PostgreSQL: ``pg_stat_database`` commits + rollbacks (``pg_stat_statements`` calls when the
    server preloads it), less the benchmark's own polls; both databases: what the processes
    counted (``bench.counting``, flushed to ``count_url``) plus ``extra`` counted in this process.
    """

    def __init__(self, database_url: str | None, count_url: str):
        self.database_url = database_url
        self.count_url = count_url
        self.polls = 0

    def open(self) -> None:
        from bench import counting

        time.sleep(0.5)  # a connection just closed publishes its counts as its backend exits
        self.pg = postgres_counters(self.database_url) if self.database_url else None
        self.counted = counting.flushed_counts(self.count_url)

    def poll(self, predicate, statements: int = 1):
        """A check of the benchmark's own (``statements`` autocommit statements), left out of the counts."""
        from bench import counting

        with counting.paused():
            self.polls += statements
            return predicate()

    def close(self, units: int, extra: dict | None = None) -> dict:
        """Per unit: ``xact`` (server; None on SQLite), ``statements``, ``counted_xact``, and the source."""
        from django.db import connections

        from bench import counting

        connections.close_all()  # the server publishes this backend's counts when it exits
        time.sleep(0.5)
        counted = counters_delta(self.counted, counting.flushed_counts(self.count_url))
        for key, value in (extra or {}).items():
            counted[key] += value
        result = {"xact": None, "statements": counted["statements"] / units,
                  "counted_xact": counted["transactions"] / units, "statements_source": "counted"}
        if self.database_url:
            delta = counters_delta(self.pg, postgres_counters(self.database_url))
            result["xact"] = (delta["xact_commit"] + delta["xact_rollback"] - self.polls - 1) / units
            if "pgss_calls" in delta:
                result["statements"] = (delta["pgss_calls"] - self.polls) / units
                result["statements_source"] = "pg_stat_statements"
        return result


# --- CPU per kind of process ----------------------------------------------------------------------

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_cpu() -> dict[int, tuple[str, float]]:
    """Every process's command line and CPU seconds so far (user + system), from ``/proc``."""
    from deploy.stack import process_stats

    found = {}
    for pid, fields in process_stats().items():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        found[pid] = (command, (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS)
    return found


class ProcessCpu:
    """CPU seconds spent between ``start()`` and ``stop(kind)`` by the processes of each kind (Linux):
    ``kind(pid, command)`` names a process's kind (None: not counted), asked at the stop, so a process
    started meanwhile (a worker replaced) counts all its CPU; one that ended meanwhile counts none of
    it (keep what is measured alive until the stop)."""

    def start(self) -> None:
        self.before, self.started = _process_cpu(), time.monotonic()

    def stop(self, kind) -> dict[str, float]:
        """The CPU seconds per kind, and ``wall``: the seconds since ``start()``."""
        after, spent = _process_cpu(), {"wall": time.monotonic() - self.started}
        for pid, (command, seconds) in after.items():
            name = kind(pid, command)
            if name is not None:
                spent[name] = spent.get(name, 0.0) + seconds - self.before.get(pid, (command, 0.0))[1]
        return spent


def stream_kind(processes: list):
    """A stream's processes by kind: this one (the producer), the clusters' (the workers), PostgreSQL's
    (the backends still open at the stop, the workers' and the producer's, and the server's own
    processes; the bare commits' backend beside the stream has ended by then) and Redis's."""
    from deploy.stack import descendants

    clusters = {pid for process in processes for pid in (process.pid, *descendants(process.pid))}
    me = os.getpid()

    def kind(pid: int, command: str) -> str | None:
        if pid == me:
            return "producer"
        if pid in clusters:
            return "workers"
        if command.startswith("postgres"):
            return "database"
        if "redis-server" in command:
            return "Redis"
        return None

    return kind
