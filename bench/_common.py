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


def scratch_database(kind: str, name: str = "orchestrator_bench") -> dict[str, str]:
    """Point this process (and children) at an empty database of ``kind`` (sqlite|postgres)."""
    env: dict[str, str] = {}
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


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM, up to 30 s, then SIGKILL to its whole session (children included); reaped."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            pass
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
