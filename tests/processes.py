"""Start real worker processes against the test database (qcluster or bare drain loops)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings
from django.db import connection

BASE_DIR = Path(settings.BASE_DIR)
REDIS_TEST_URL = os.environ.get("REDIS_TEST_URL", "redis://127.0.0.1:6379/15")


def database_env() -> dict[str, str]:
    """Environment that points a child process at the database this test uses."""
    db = connection.settings_dict
    env = {key: value for key, value in os.environ.items() if key not in ("DATABASE_URL", "REDIS_URL")}
    if connection.vendor == "postgresql":
        user = db.get("USER") or "postgres"
        host = db.get("HOST") or "127.0.0.1"
        port = db.get("PORT") or 5432
        env["DATABASE_URL"] = f"postgres://{user}@{host}:{port}/{db['NAME']}"
    else:
        env["ORCHESTRATOR_SQLITE_PATH"] = str(db["NAME"])
    return env


def worker_env(**overrides) -> dict[str, str]:
    env = database_env()
    env.update({
        "ORCHESTRATOR_QUEUE_LEASE_S": "2",
        "ORCHESTRATOR_QUEUE_MAINTENANCE_INTERVAL_MS": "200",
        "ORCHESTRATOR_QUEUE_MAX_PER_PROJECT": "100000",
        "ORCHESTRATOR_QUEUE_MAX_GLOBAL": "100000",
        "ORCHESTRATOR_Q_TIMEOUT_S": "60",
        "ORCHESTRATOR_Q_RETRY_S": "90",
        "PYTHONUNBUFFERED": "1",
        # Keep the child logs to what a failing test needs (every transition is an INFO line).
        "ORCHESTRATOR_TRANSITION_LOG_LEVEL": "WARNING",
    })
    env.update({key: str(value) for key, value in overrides.items()})
    return env


def redis_available() -> bool:
    try:
        import redis

        redis.Redis.from_url(REDIS_TEST_URL, socket_connect_timeout=1).ping()
        return True
    except Exception:
        return False


def flush_redis() -> None:
    import redis

    redis.Redis.from_url(REDIS_TEST_URL).flushdb()


class Cluster:
    """A ``manage.py qcluster`` child process, stopped (and killed if needed) on exit."""

    def __init__(self, log_path: Path, **env_overrides):
        self.log_path = log_path
        self.env = worker_env(**env_overrides)
        self.process: subprocess.Popen | None = None

    def start(self) -> "Cluster":
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen([sys.executable, "manage.py", "qcluster"], cwd=BASE_DIR, env=self.env,
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def stop(self, timeout: float = 30) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        try:  # children that outlived the sentinel
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
        return self.process.returncode

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def wait_for(predicate, *, timeout: float, interval: float = 0.1, message: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Daphne:
    """A daphne child process serving the ASGI application on a free port."""

    def __init__(self, log_path: Path, **env_overrides):
        self.log_path = log_path
        self.env = worker_env(**{"DB_POOL_MAX_SIZE": 8, **env_overrides})
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    def start(self) -> "Daphne":
        import socket

        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port),
             "orchestrator_site.asgi:application"],
            cwd=BASE_DIR, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

        def listening():
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", self.port)) == 0

        wait_for(listening, timeout=30, message="daphne listening")
        return self

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        self.log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def restart_postgres() -> None:
    """Restart the local PostgreSQL server (drills and the relay's reconnect test)."""
    versions = sorted(os.listdir("/etc/postgresql"))
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "restart"], check=True,
                   capture_output=True, timeout=120)
