"""Event delivery latency: commit → WebSocket receipt through our relay, next to a bare
Channels ``group_send`` to the same number of clients on the same daphne, in the same run.

    .venv/bin/python bench/events.py [--db sqlite|postgres] [--events 1000] [--rate 20]

For 1 and 100 connected clients: N events are committed at ``rate`` per second (each in its own
transaction, stamped with its commit time); every client records receipt time − commit time.
Prints p50/p99 per scenario, and daphne's resident memory with 500 idle connected clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(BASE))
from bench._common import percentile, scratch_database  # noqa: E402


def start_daphne(port: int, log: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
                                "bench.asgi:application"], cwd=BASE, env=dict(os.environ),
                               stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    time.sleep(2.5)
    return process


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def open_clients(port, count, cookie, path="/ws/events/", subscribe=None):
    import websockets

    clients = []
    for _ in range(count):
        socket = await websockets.connect(f"ws://127.0.0.1:{port}{path}", origin="http://localhost",
                                          additional_headers={"Cookie": cookie}, max_queue=None)
        if subscribe is not None:
            json.loads(await socket.recv())  # hello
            await socket.send(json.dumps(subscribe))
            json.loads(await socket.recv())  # subscribed
        clients.append(socket)
    return clients


async def collect(socket, count, latencies, key="ts", timeout=120):
    got = 0
    deadline = time.time() + timeout
    while got < count and time.time() < deadline:
        message = json.loads(await asyncio.wait_for(socket.recv(), timeout=max(0.1, deadline - time.time())))
        if key in message and (message.get("type") == "bench_event" or "n" in message):
            latencies.append((time.time() - float(message[key])) * 1000)
            got += 1


async def ours(port, clients_n, events, rate, cookie, organization_id):
    from asgiref.sync import sync_to_async

    from core.services import event_record

    clients = await open_clients(port, clients_n, cookie, subscribe={"action": "subscribe",
                                                                     "organization": organization_id})
    latencies: list[float] = []
    readers = [asyncio.create_task(collect(c, events, latencies, key="sent")) for c in clients]

    def commit(index):
        event_record(type="bench_event", organization_id=organization_id, payload={"n": index, "sent": time.time()})

    for index in range(events):
        await sync_to_async(commit, thread_sensitive=True)(index)
        await asyncio.sleep(1 / rate)
    await asyncio.gather(*readers)
    for c in clients:
        await c.close()
    return latencies


async def baseline(port, clients_n, events, rate, cookie):
    clients = await open_clients(port, clients_n, cookie, path="/ws/bench/")
    await asyncio.sleep(0.5)
    latencies: list[float] = []
    readers = [asyncio.create_task(collect(c, events, latencies)) for c in clients]
    await clients[0].send(json.dumps({"fire": events, "rate": rate}))
    try:
        await asyncio.wait_for(asyncio.gather(*readers), timeout=events / rate + 30)
    except asyncio.TimeoutError:
        pass
    for c in clients:
        await c.close()
    return latencies, clients_n * events


async def idle_memory(port, cookie, pid, count=500):
    before = rss_mb(pid)
    clients = await open_clients(port, count, cookie, subscribe={"action": "subscribe", "all": True})
    await asyncio.sleep(2)
    after = rss_mb(pid)
    for c in clients:
        await c.close()
    return before, after


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=20.0)
    args = parser.parse_args()
    scratch_database(args.db, name="orchestrator_bench_events")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.test import Client

    from billing.services import organization_create

    organization, _, _, _ = organization_create(name="bench", owner_username="bench-owner")
    staff = get_user_model().objects.create_superuser("bench-staff", password="x")
    client = Client()
    client.force_login(staff)
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
    port = 8765
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    daphne = start_daphne(port, out / "events-daphne.log")
    try:
        rows = []
        for clients_n in (1, 100):
            ours_lat = asyncio.run(ours(port, clients_n, args.events, args.rate, cookie, organization.pk))
            base_lat, expected = asyncio.run(baseline(port, clients_n, args.events, args.rate, cookie))
            rows.append((clients_n, ours_lat, base_lat, expected))
        before, after = asyncio.run(idle_memory(port, cookie, daphne.pid))
    finally:
        daphne.send_signal(signal.SIGTERM)
        daphne.wait(20)
    print(f"database={args.db} events={args.events} rate={args.rate:g}/s (relay: "
          f"{'LISTEN/NOTIFY' if args.db == 'postgres' else 'polling 100 ms'})")
    for clients_n, ours_lat, base_lat, expected in rows:
        print(f"{clients_n:>3} clients  relay : p50 {percentile(ours_lat, 50):6.1f} ms  p99 "
              f"{percentile(ours_lat, 99):6.1f} ms  delivered {len(ours_lat)}/{clients_n * args.events}")
        print(f"{clients_n:>3} clients  bare group_send: p50 {percentile(base_lat, 50):6.1f} ms  p99 "
              f"{percentile(base_lat, 99):6.1f} ms  delivered {len(base_lat)}/{expected}")
    print(f"daphne RSS: {before:.1f} MB idle, {after:.1f} MB with 500 connected clients "
          f"({(after - before) * 1024 / 500:.1f} KB per connection)")


if __name__ == "__main__":
    main()
