"""Scale out on one machine: PostgreSQL, Redis, two ``qcluster`` and two daphne processes.

    .venv/bin/python -m deploy.scale_out [--clusters 2] [--ports 8001,8002] [--host 127.0.0.1]

Reads ``DATABASE_URL`` (default ``postgres://postgres@127.0.0.1:5432/orchestrator``) and
``REDIS_URL`` (default ``redis://127.0.0.1:6379/0``). Starts the local PostgreSQL cluster
serving that port and a ``redis-server`` when they do not answer, creates the database when
missing, migrates, then starts the processes, prints their URLs and waits. Ctrl-C (or SIGTERM)
stops every process it started, services included; if one of them exits, the rest are stopped
and the exit code is 1. Logs go to ``var/scale/``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from deploy.stack import (
    BASE_DIR,
    DEFAULT_DATABASE_URL,
    DEFAULT_REDIS_URL,
    Deployment,
    StackError,
    ensure_database,
    ensure_postgres,
    ensure_redis,
    migrate,
    python_env,
    stack_stop,
)


def parse_ports(raw: str) -> list[int]:
    try:
        ports = [int(item) for item in raw.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r}: comma-separated port numbers, e.g. 8001,8002") from None
    if not ports or any(not 0 < port < 65536 for port in ports) or len(set(ports)) != len(ports):
        raise argparse.ArgumentTypeError(f"{raw!r}: distinct port numbers from 1 to 65535")
    return ports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.scale_out", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clusters", type=int, default=2, choices=range(1, 9), metavar="N",
                        help="qcluster processes (default 2)")
    parser.add_argument("--ports", type=parse_ports, default=[8001, 8002],
                        help="one daphne process per port (default 8001,8002)")
    parser.add_argument("--host", default="127.0.0.1", help="address daphne binds (default 127.0.0.1)")
    parser.add_argument("--log-dir", type=Path, default=BASE_DIR / "var" / "scale")
    args = parser.parse_args(argv)

    database_url = os.environ.get("DATABASE_URL", "").strip() or DEFAULT_DATABASE_URL
    redis_url = os.environ.get("REDIS_URL", "").strip() or DEFAULT_REDIS_URL
    stopping = {"signal": None}

    def on_signal(signum, frame):
        stopping["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    started_postgres = redis_child = deployment = None
    code = 0
    try:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        started_postgres = ensure_postgres(database_url)
        print(f"PostgreSQL  {database_url}  ({'started ' + started_postgres if started_postgres else 'running'})")
        redis_child = ensure_redis(redis_url, args.log_dir)
        print(f"Redis       {redis_url}  ({'started, pid %d' % redis_child.pid if redis_child else 'running'})")
        if ensure_database(database_url):
            print(f"created database {database_url.rsplit('/', 1)[1]}")
        migrate(python_env(DATABASE_URL=database_url, REDIS_URL=redis_url))
        print("migrated")
        deployment = Deployment(database_url=database_url, redis_url=redis_url, clusters=args.clusters,
                                web_ports=args.ports, host=args.host, log_dir=args.log_dir)
        deployment.start()
        for cluster in deployment.workers:
            print(f"{cluster.name:<11} pid {cluster.pid}  log {cluster.log_path}")
        for index, web in enumerate(deployment.webs):
            print(f"{web.name:<11} pid {web.pid}  {deployment.url(index, '/admin/')}  "
                  f"{deployment.ws_url(index)}  log {web.log_path}")
        print("Ready. Ctrl-C stops everything.", flush=True)
        while stopping["signal"] is None:
            exited = deployment.exited()
            if exited:
                for child in exited:
                    print(f"{child.name} exited with code {child.process.returncode}: see {child.log_path}",
                          file=sys.stderr)
                code = 1
                break
            time.sleep(0.2)
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        stack_stop(deployment, redis_child, started_postgres)
        print("stopped", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
