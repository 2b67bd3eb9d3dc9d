"""API throughput and latency against a real daphne process, next to a trivial DRF endpoint.

    .venv/bin/python bench/api.py [--db sqlite|postgres] [--seconds 5] [--clients 1,16]
                                  [--collection-rows 1000000]

One daphne process serves a scratch database. For each number of concurrent clients (threads,
each with its own keep-alive connection and token), each endpoint is driven for ``--seconds``
after a short warm-up:

* ``GET ping/``            the trivial DRF endpoint (token auth, no other query): the baseline;
* ``GET runs/{id}/``       a run with its counts (6 queries);
* ``POST runs/`` + key     a new run per request, each with a fresh ``Idempotency-Key``
                           (claim, create, store the response: 3 transactions);
* ``POST runs/`` replay    the same key and body again: the stored answer;
* with ``--collection-rows N``, the large collections of an organization in a database seeded
  with N runs and N ledger entries (``bench/admin_seed.py``: ten organizations, so a tenth of
  the rows are the caller's): ``runs/``, ``ledger/``, ``jobs/``, ``events/?limit=50``, and a page
  four cursors deep of ``runs/`` and ``ledger/`` and of ``events/`` by ``after=`` (each page is
  read by keyset: its cost does not follow the depth or the table's size).

Printed: requests/s, p50 and p99 latency, and each endpoint's ratios to ping at the same
concurrency (throughput ratio, p50 and p99 ratios). The server runs without request rate limits
unless ``--rate`` gives one (``--rate 1000000/minute`` counts every request without refusing
any: the cost of the limiter).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

BENCH_DIR = str(Path(__file__).resolve().parent)
sys.path.insert(0, BENCH_DIR)
from _common import percentile, scratch_database, start_process, stop_process, wait_until  # noqa: E402

# bench/queue.py would shadow the standard library's queue module (imported by asgiref).
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != BENCH_DIR]

PLAN = {"agents": [{"name": "a", "tasks": [{"name": "t", "steps": [
    {"name": "s", "tool": "echo", "args": {"text": "hi"}}]}]}]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_daphne(port: int, log: Path, conn_max_age: int, server_env: dict) -> subprocess.Popen:
    # Under ASGI every request runs in a thread of its own, so a persistent connection
    # (DB_CONN_MAX_AGE > 0) is left open per request until garbage collection: on PostgreSQL
    # 16 clients exhaust max_connections within seconds. Hence 0 for daphne by default.
    return start_process([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                          "orchestrator_site.asgi:application"],
                         {"DB_CONN_MAX_AGE": str(conn_max_age), **server_env}, log)


class Endpoint:
    def __init__(self, name: str, method: str, path: str, body=None, fresh_key: bool = False,
                 key: str | None = None, expect: int = 200, token: str | None = None):
        self.name, self.method, self.path, self.body = name, method, path, body
        self.fresh_key, self.key, self.expect, self.token = fresh_key, key, expect, token

    def request(self, connection: http.client.HTTPConnection, token: str) -> None:
        headers = {"Authorization": f"Token {token}", "Accept": "application/json"}
        payload = None
        if self.body is not None:
            payload = json.dumps(self.body)
            headers["Content-Type"] = "application/json"
        if self.fresh_key or self.key:
            headers["Idempotency-Key"] = uuid.uuid4().hex if self.fresh_key else self.key
        connection.request(self.method, self.path, body=payload, headers=headers)
        response = connection.getresponse()
        response.read()
        if response.status != self.expect:
            raise RuntimeError(f"{self.name}: HTTP {response.status}")


def _get_json(port: int, token: str, path: str) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("GET", path, headers={"Authorization": f"Token {token}", "Accept": "application/json"})
    response = connection.getresponse()
    body = response.read()
    connection.close()
    if response.status != 200:
        raise RuntimeError(f"GET {path}: HTTP {response.status}")
    return json.loads(body)


def collection_endpoints(port: int, token: str) -> list[Endpoint]:
    """The large collections as the seeded organization's owner: each first page, and a page four
    cursors in (``next`` links; ``after=`` for events)."""
    endpoints = [Endpoint(f"GET {path}", "GET", f"/api/v1/{path}", token=token)
                 for path in ("runs/", "ledger/", "jobs/", "events/?limit=50")]
    for path, how in (("runs/", "cursor"), ("ledger/", "cursor"), ("events/?limit=50", "after=")):
        deep = f"/api/v1/{path}"
        page = _get_json(port, token, deep)
        for _ in range(4):
            if not page.get("next"):
                break  # a small database: the deepest page there is
            parts = urlsplit(page["next"])
            deep = f"{parts.path}?{parts.query}"
            page = _get_json(port, token, deep)
        endpoints.append(Endpoint(f"GET {path.split('?')[0]} deep ({how})", "GET", deep, token=token))
    return endpoints


def drive(endpoint: Endpoint, *, port: int, token: str, clients: int, seconds: float,
          warmup: float = 1.0) -> dict:
    """``clients`` threads send requests back to back; latencies of the measured window only."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors: list[str] = []
    start_at = time.monotonic() + 0.2
    measure_from = start_at + warmup
    stop_at = measure_from + seconds

    def client(index: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while time.monotonic() < start_at:
            time.sleep(0.001)
        try:
            while True:
                began = time.monotonic()
                if began >= stop_at:
                    break
                endpoint.request(connection, token)
                ended = time.monotonic()
                if began >= measure_from:
                    latencies[index].append((ended - began) * 1000)
        except Exception as exc:  # reported below
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            connection.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"{endpoint.name} with {clients} clients: {errors[0]} ({len(errors)} errors)")
    flat = [value for values in latencies for value in values]
    return {"rps": len(flat) / seconds, "p50": percentile(flat, 50), "p99": percentile(flat, 99), "n": len(flat)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--clients", default="1,16")
    parser.add_argument("--conn-max-age", type=int, default=0, help="DB_CONN_MAX_AGE of the daphne process")
    parser.add_argument("--rate", default="", help="ORCHESTRATOR_API_RATE of the server (default: no limit)")
    parser.add_argument("--collection-rows", type=int, default=0,
                        help="seed this many runs and ledger entries and measure the large collections")
    parser.add_argument("--server-settings", default="",
                        help="another DJANGO_SETTINGS_MODULE for daphne (e.g. one with a connection pool)")
    args = parser.parse_args()
    concurrency = [int(value) for value in args.clients.split(",")]

    scratch_database(args.db, name="orchestrator_bench_api")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from rest_framework.authtoken.models import Token

    from billing.services import organization_create
    from runs.services import run_create

    _, project, owner, _ = organization_create(name="bench", owner_username="bench", credits=10**12)
    token = Token.objects.create(user=owner).key
    collection_token = None
    if args.collection_rows:
        from django.contrib.auth import get_user_model

        from bench.admin_seed import seed

        seed(runs=args.collection_rows, ledger=args.collection_rows, out=sys.stdout)
        collection_token = Token.objects.create(user=get_user_model().objects.get(username="bench-owner-0")).key
    run = run_create(project=project, name="bench", plan=PLAN)
    replay_body = {"project": project.pk, "name": "replayed", "plan": PLAN}
    endpoints = [
        Endpoint("GET ping/ (trivial DRF)", "GET", "/api/v1/ping/"),
        Endpoint("GET runs/{id}/", "GET", f"/api/v1/runs/{run.pk}/"),
        Endpoint("POST runs/ + new key", "POST", "/api/v1/runs/", {"project": project.pk, "name": "bench",
                                                                   "plan": PLAN}, fresh_key=True, expect=201),
        Endpoint("POST runs/ replayed key", "POST", "/api/v1/runs/", replay_body, key="replayed-key", expect=201),
    ]
    from django.db import connections

    connections.close_all()

    logs = Path(__file__).resolve().parent / "out"
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server_env = {"ORCHESTRATOR_API_RATE": args.rate, "ORCHESTRATOR_API_ANON_RATE": args.rate}
    if args.server_settings:
        server_env["DJANGO_SETTINGS_MODULE"] = args.server_settings
    server = start_daphne(port, logs / "api-daphne.log", args.conn_max_age, server_env)
    try:
        def ready() -> bool:
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                connection.request("GET", "/api/v1/health/")
                connection.getresponse().read()
                return True
            except OSError:
                return False

        wait_until(ready, timeout=60, interval=0.2)
        if collection_token:
            endpoints += collection_endpoints(port, collection_token)
        results: dict[tuple[str, int], dict] = {}
        for clients in concurrency:
            for endpoint in endpoints:
                results[(endpoint.name, clients)] = drive(
                    endpoint, port=port, token=endpoint.token or token, clients=clients, seconds=args.seconds)
    finally:
        stop_process(server)

    print(f"database={args.db} server=daphne (1 process, DB_CONN_MAX_AGE={args.conn_max_age}"
          f"{', settings ' + args.server_settings if args.server_settings else ''}, "
          f"rate limit {args.rate or 'none'}) "
          f"window={args.seconds:g}s per row; "
          f"ratios are to GET ping/ at the same concurrency")
    print(f"{'endpoint':<30}{'clients':>8}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'rps ratio':>11}"
          f"{'p50 ratio':>11}{'p99 ratio':>11}")
    for clients in concurrency:
        base = results[(endpoints[0].name, clients)]
        for endpoint in endpoints:
            row = results[(endpoint.name, clients)]
            print(f"{endpoint.name:<30}{clients:>8}{row['rps']:>10.1f}{row['p50']:>9.1f}{row['p99']:>9.1f}"
                  f"{row['rps'] / base['rps']:>11.2f}{row['p50'] / base['p50']:>11.2f}{row['p99'] / base['p99']:>11.2f}")


if __name__ == "__main__":
    main()
