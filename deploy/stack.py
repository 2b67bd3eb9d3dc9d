"""The pieces of a one-machine deployment: PostgreSQL, Redis, ``qcluster`` and daphne processes.

Every ``qcluster`` shares the database, the Redis broker and the cluster name (django-q2's
Redis queue is named after it), so they take wake messages from one queue and claim jobs from
one table. Every daphne process runs its own relay from the event table, so a WebSocket client
on any of them sees every event, whichever cluster wrote it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

BASE_DIR = Path(__file__).resolve().parent.parent
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/orchestrator"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
LOCAL_HOSTS = {"", "127.0.0.1", "localhost", "::1"}


class StackError(Exception):
    """A service is missing or a process could not start; the message says which and why."""


# --- PostgreSQL -------------------------------------------------------------------------------

def _database_parts(database_url: str):
    parts = urlsplit(database_url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise StackError(f"{database_url!r} is not a postgres:// URL")
    name = parts.path.lstrip("/")
    if not name:
        raise StackError(f"{database_url!r} names no database")
    return parts, name


def server_url(database_url: str, dbname: str = "postgres") -> str:
    """The same server and credentials, another database (``postgres`` by default)."""
    parts, _ = _database_parts(database_url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{dbname}", parts.query, ""))


def database_name(database_url: str) -> str:
    return _database_parts(database_url)[1]


def postgres_ready(database_url: str) -> bool:
    import psycopg

    try:
        with psycopg.connect(server_url(database_url), connect_timeout=2):
            return True
    except psycopg.Error:
        return False


def postgres_cluster_for(database_url: str) -> str | None:
    """The local cluster (``15/main``) serving the URL's port, from ``pg_lsclusters``."""
    if shutil.which("pg_lsclusters") is None:
        return None
    parts, _ = _database_parts(database_url)
    if (parts.hostname or "") not in LOCAL_HOSTS:
        return None
    port = parts.port or 5432
    listing = subprocess.run(["pg_lsclusters", "--no-header"], capture_output=True, text=True, check=False).stdout
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2] == str(port):
            return f"{fields[0]}/{fields[1]}"
    return None


def _pg_ctlcluster(cluster: str, action: str) -> None:
    version, name = cluster.split("/", 1)
    result = subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, name, action],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise StackError(f"pg_ctlcluster {version} {name} {action} failed: {result.stderr.strip() or result.stdout}")


def wait_postgres(database_url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if postgres_ready(database_url):
            return
        time.sleep(0.2)
    raise StackError(f"PostgreSQL at {server_url(database_url)} did not answer within {timeout:g}s")


def ensure_postgres(database_url: str) -> str | None:
    """Start the local cluster serving ``database_url`` when it does not answer.

    Returns the cluster started here (to stop it afterwards), or None when it was running.
    """
    if postgres_ready(database_url):
        return None
    cluster = postgres_cluster_for(database_url)
    if cluster is None:
        raise StackError(f"PostgreSQL at {server_url(database_url)} does not answer, and no local cluster "
                         "(pg_lsclusters) listens on that port: start it, or point DATABASE_URL at a running server")
    _pg_ctlcluster(cluster, "start")
    wait_postgres(database_url)
    return cluster


def stop_postgres(cluster: str) -> None:
    _pg_ctlcluster(cluster, "stop")


def stack_stop(deployment: "Deployment | None", redis_child: "Child | None", started_postgres: str | None) -> None:
    """Stop what a script brought up, last started first: the deployment, then Redis and PostgreSQL
    where the script started them (a server that was already running is left running)."""
    if deployment is not None:
        deployment.stop()
    if redis_child is not None:
        redis_child.stop()
    if started_postgres:
        stop_postgres(started_postgres)


def restart_postgres(cluster: str) -> None:
    """Restart a local cluster (``pg_ctlcluster ... restart``: every connection is cut)."""
    _pg_ctlcluster(cluster, "restart")


def ensure_database(database_url: str) -> bool:
    """Create the URL's database when it does not exist; True when it was created."""
    import psycopg

    name = database_name(database_url)
    with psycopg.connect(server_url(database_url), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            return False
        conn.execute(f'CREATE DATABASE "{name}"')
        return True


def recreate_database(database_url: str) -> None:
    """Drop (closing its connections) and create the URL's database: a scratch database."""
    import psycopg

    name = database_name(database_url)
    with psycopg.connect(server_url(database_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


# --- Redis ------------------------------------------------------------------------------------

def redis_ready(redis_url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def ensure_redis(redis_url: str, log_dir: Path) -> "Child | None":
    """Start ``redis-server`` (a child process, no persistence) when the URL's server does not answer.

    Returns the child started here (to stop it afterwards), or None when Redis was running.
    """
    if redis_ready(redis_url):
        return None
    parts = urlsplit(redis_url)
    if (parts.hostname or "") not in LOCAL_HOSTS:
        raise StackError(f"Redis at {redis_url} does not answer; start it or point REDIS_URL at a running server")
    if shutil.which("redis-server") is None:
        raise StackError(f"Redis at {redis_url} does not answer and redis-server is not installed")
    port = parts.port or 6379
    child = Child("redis", ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                            "--appendonly", "no", "--dir", str(log_dir)], dict(os.environ), log_dir / "redis.log")
    child.start()
    deadline = time.monotonic() + 30
    while not redis_ready(redis_url):
        if not child.alive or time.monotonic() > deadline:
            child.stop()
            raise StackError(f"redis-server did not start on port {port}: see {child.log_path}")
        time.sleep(0.1)
    return child


def flush_redis(redis_url: str) -> None:
    import redis

    redis.Redis.from_url(redis_url).flushdb()


# --- processes --------------------------------------------------------------------------------

def port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, port)) == 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def process_stats() -> dict[int, list[str]]:
    """Each live process's ``/proc/<pid>/stat`` fields after its command name: its state, its
    parent, ... (field 3 onwards of ``proc(5)``; user and system CPU ticks at 11 and 12)."""
    found: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        found[int(entry)] = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and ")"
    return found


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, grandchildren ...), read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for child, fields in process_stats().items():
        children.setdefault(int(fields[1]), []).append(child)
    found: set[int] = set()
    pending = [pid]
    while pending:
        for child in children.get(pending.pop(), ()):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


@dataclass
class Child:
    """One child process in its own session (so its whole group can be stopped), logging to a file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> "Child":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv, cwd=BASE_DIR, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        return self

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 30, sig: int | None = signal.SIGTERM) -> int | None:
        """Send ``sig`` (None: already sent), wait up to ``timeout``, then kill what is left of the
        group. Returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            try:
                if sig is not None:
                    self.process.send_signal(sig)
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill_group()
                self.process.wait(10)
        self._kill_group()  # workers that outlived their parent
        return self.process.returncode

    def _kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def python_env(base: dict[str, str] | None = None, **overrides) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update({"PYTHONUNBUFFERED": "1", "DJANGO_SETTINGS_MODULE": "orchestrator_site.settings"})
    env.update({key: str(value) for key, value in overrides.items()})
    return env


def migrate(env: dict[str, str]) -> None:
    result = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=BASE_DIR, env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise StackError(f"migrate failed:\n{(result.stdout + result.stderr)[-3000:]}")


@dataclass
class Deployment:
    """``clusters`` × ``qcluster`` and one daphne per port, all on one database and one Redis broker."""

    database_url: str
    redis_url: str
    clusters: int = 2
    web_ports: list[int] = field(default_factory=lambda: [8001, 8002])
    host: str = "127.0.0.1"
    log_dir: Path = BASE_DIR / "var" / "scale"
    env: dict[str, str] = field(default_factory=dict)
    workers: list[Child] = field(default_factory=list, init=False)
    webs: list[Child] = field(default_factory=list, init=False)

    def child_env(self, **extra) -> dict[str, str]:
        return python_env(DATABASE_URL=self.database_url, REDIS_URL=self.redis_url, **{**self.env, **extra})

    def start(self) -> "Deployment":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for port in self.web_ports:
            if port_open(self.host, port):
                raise StackError(f"port {port} on {self.host} is already in use")
        for number in range(1, self.clusters + 1):
            self.workers.append(Child(f"qcluster {number}", [sys.executable, "manage.py", "qcluster"],
                                      self.child_env(), self.log_dir / f"qcluster-{number}.log").start())
        # daphne runs each request in some thread: pooled PostgreSQL connections there.
        pool = self.env.get("DB_POOL_MAX_SIZE") or os.environ.get("DB_POOL_MAX_SIZE") or "8"
        for number, port in enumerate(self.web_ports, start=1):
            argv = [sys.executable, "-m", "daphne", "-b", self.host, "-p", str(port),
                    "orchestrator_site.asgi:application"]
            self.webs.append(Child(f"daphne {number}", argv, self.child_env(DB_POOL_MAX_SIZE=pool),
                                   self.log_dir / f"daphne-{number}.log").start())
        deadline = time.monotonic() + 60
        for web, port in zip(self.webs, self.web_ports):
            while not port_open(self.host, port):
                if not web.alive:
                    raise StackError(f"{web.name} exited with code {web.process.returncode}: see {web.log_path}")
                if time.monotonic() > deadline:
                    raise StackError(f"{web.name} is not listening on port {port}: see {web.log_path}")
                time.sleep(0.1)
        return self

    def url(self, index: int, path: str = "/") -> str:
        return f"http://{self.host}:{self.web_ports[index]}{path}"

    def ws_url(self, index: int) -> str:
        return f"ws://{self.host}:{self.web_ports[index]}/ws/events/"

    def children(self) -> list[Child]:
        return self.workers + self.webs

    def exited(self) -> list[Child]:
        return [child for child in self.children() if child.process is not None and not child.alive]

    def cluster_of(self, pid: int) -> int | None:
        """The index of the cluster a worker process belongs to (None: not one of ours)."""
        for index, cluster in enumerate(self.workers):
            if cluster.alive and pid in descendants(cluster.pid):
                return index
        return None

    def restart_cluster(self, index: int, *, timeout: float = 120) -> tuple[int | None, float]:
        """SIGTERM a cluster, wait for it to stop, start it again. Returns (exit code, seconds to stop)."""
        cluster = self.workers[index]
        began = time.monotonic()
        code = cluster.stop(timeout=timeout)
        stopped_in = time.monotonic() - began
        replacement = Child(cluster.name, cluster.argv, cluster.env, cluster.log_path).start()
        self.workers[index] = replacement
        return code, stopped_in

    def stop(self) -> None:
        for child in self.children():  # signal all first: they stop in parallel
            if child.alive:
                child.process.send_signal(signal.SIGTERM)
        for child in self.children():
            child.stop(timeout=45, sig=None)
