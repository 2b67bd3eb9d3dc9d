"""The floor under a queue that commits before it runs a job: how long a bare PostgreSQL commit takes
while a benchmark runs beside it.

    .venv/bin/python -m bench.commit_probe DATABASE_URL SECONDS [--every-ms 10]

Every ``--every-ms`` ms, on a connection of its own, one row is inserted into a table of its own
and committed (the commit waits for its WAL to reach the disk, as every enqueue, claim and
completion of our queue does); the commits' latencies are printed as one JSON object (``count``,
``p50``, ``p99``, ``max`` in ms, ``over_20_ms``) when ``SECONDS`` have passed (0: when it is sent
SIGTERM). ``bench/scale.py`` runs it beside each pass and each latency stream: a commit of one row
stalled for 100 ms tells that the disk's flush stalled, and every job enqueued, claimed or completed
in that moment waited for the same flush.
"""

from __future__ import annotations

import argparse
import json
import signal
import time

import psycopg

TABLE = "bench_commit_probe"


def probe(database_url: str, seconds: float, every_ms: float) -> dict:
    latencies: list[float] = []
    with psycopg.connect(database_url) as conn:
        conn.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigserial PRIMARY KEY, at timestamptz NOT NULL)")
        conn.commit()
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
        end = time.monotonic() + seconds if seconds > 0 else float("inf")
        next_at = time.monotonic()
        while next_at < end and not stop:
            time.sleep(max(0.0, next_at - time.monotonic()))
            started = time.perf_counter()
            conn.execute(f"INSERT INTO {TABLE} (at) VALUES (now())")
            conn.commit()
            latencies.append((time.perf_counter() - started) * 1000)
            next_at += every_ms / 1000
        conn.execute(f"DROP TABLE {TABLE}")
        conn.commit()
    latencies.sort()

    def at(q: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(len(latencies) * q))], 2) if latencies else 0.0

    return {"count": len(latencies), "p50": at(0.5), "p99": at(0.99),
            "max": round(latencies[-1], 1) if latencies else 0.0,
            "over_20_ms": sum(1 for latency in latencies if latency > 20)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("database_url")
    parser.add_argument("seconds", type=float)
    parser.add_argument("--every-ms", type=float, default=10.0)
    args = parser.parse_args()
    print(json.dumps(probe(args.database_url, args.seconds, args.every_ms)), flush=True)


if __name__ == "__main__":
    main()
