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
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TABLE = "bench_commit_probe"


def probe(database_url: str, seconds: float, every_ms: float) -> dict:
    import psycopg

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


# How often a bare commit is timed beside a throughput pass: often enough to see a stall of the
# disk's flush, seldom enough to add nothing the pass would feel (20 commits/s against thousands of jobs).
PASS_PROBE_MS = 50


@contextmanager
def beside(every_ms: float, seconds: float = 0, *, timeout: float = 60) -> Iterator[dict]:
    """On PostgreSQL (``DATABASE_URL`` set), this probe committing one row every ``every_ms`` ms in a
    process of its own beside what the block measures (for ``seconds``, or until the block ends); its
    figures are put into the dict yielded once it stopped (left empty on SQLite)."""
    found: dict = {}
    url = os.environ.get("DATABASE_URL")
    if not url:
        yield found
        return
    process = subprocess.Popen([sys.executable, "-m", "bench.commit_probe", url, str(seconds), "--every-ms",
                                str(every_ms)], stdout=subprocess.PIPE, text=True,
                               cwd=Path(__file__).resolve().parent.parent)
    try:
        yield found
    finally:
        if not seconds:
            process.terminate()
        output = process.communicate(timeout=timeout)[0]
        if output.strip():
            found.update(json.loads(output))


def flushes_text(flushes: dict | None) -> str:
    """A pass's bare commits, as its line prints them ("" when there were none)."""
    if not flushes:
        return ""
    return (f"; a bare commit beside it: p50 {flushes['p50']:.1f} ms, max {flushes['max']:.0f} ms, "
            f"{flushes['over_20_ms']} of {flushes['count']} over 20 ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("database_url")
    parser.add_argument("seconds", type=float)
    parser.add_argument("--every-ms", type=float, default=10.0)
    args = parser.parse_args()
    print(json.dumps(probe(args.database_url, args.seconds, args.every_ms)), flush=True)


if __name__ == "__main__":
    main()
