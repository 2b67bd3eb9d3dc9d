"""What a steady stream costs, rate by rate: queued -> executing p50/p99 and the CPU each kind of process
spends per job, for fixed streams of our queue, and a straight line through the CPU they took.

    .venv/bin/python bench/stream_curve.py [--rates 300,600,900,1200,1500] [--seconds 8] [--runs 2]
                                           [--clusters 1] [--sqlite]

Each stream is ``bench/scale.py``'s latency measure (the jobs due every 10 ms enqueued in one
``jobs_enqueue_many`` call by this process, fresh clusters of 2 workers, the stream's first second
reported apart) at a fixed rate, on the same scratch database and Redis; ``--runs`` streams per
rate, in turn (300, 600, ..., then again), so a drift of the machine's speed spreads over all rates.
Per stream: p50/p99 after its first second, the CPU per job of the producer (this process), the
clusters' processes, PostgreSQL's and Redis's (``/proc``), and the share of the machine's cores they
took. Then the least-squares line ``cores = fixed + per_job x rate`` over every stream: ``fixed`` is
what the stream's machinery costs whatever its number of jobs (an enqueue call, a wake message and a
drain per tick: ``fixed x TICK`` of CPU per tick), ``per_job`` what each job adds; and the highest
rate whose every stream kept its p99 under 20 ms. ``bench/scale.py``'s default stream (60 % of a
drain's rate) can then be read off the line: a p99 in the tens of ms needs headroom on the cores.

FAILS (exit status 1) when a job of any stream is lost or executed more than once, or nothing
progresses for 60 s. Needs what ``bench/scale.py`` needs (PostgreSQL, Redis; not Celery). With
``--sqlite`` the database's CPU is spent inside the processes that use it (it reads 0).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != HERE]  # (bench/queue.py)
sys.path.insert(0, str(HERE.parent))
from bench import scale  # noqa: E402

P99_GOAL_MS = 20.0


def line_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` through ``points``; ``(a, b)`` (``b`` 0 for a single ``x``)."""
    if len({x for x, _ in points}) < 2:
        return sum(y for _, y in points) / len(points), 0.0
    slope, intercept = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return intercept, slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="300,600,900,1200,1500", help="jobs/s of the streams, comma-separated")
    parser.add_argument("--seconds", type=float, default=8, help="length of each stream")
    parser.add_argument("--runs", type=int, default=2, help="streams per rate")
    parser.add_argument("--clusters", type=int, default=1)
    parser.add_argument("--sqlite", action="store_true", help="SQLite and the ORM broker")
    args = parser.parse_args()
    try:
        rates = [float(rate) for rate in args.rates.split(",") if rate.strip()]
    except ValueError:
        sys.exit("--rates: numbers separated by commas")
    if not rates or min(rates) <= 0 or args.seconds <= scale.FIRST_S or args.runs < 1 or args.clusters < 1:
        sys.exit(f"--rates positive, --seconds over {scale.FIRST_S:g}, --runs and --clusters at least 1")
    _, child_env, project = scale.prepare(sqlite=args.sqlite, concurrency=128)
    out = HERE / "out"
    out.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    print(f"queued -> executing under fixed streams of our queue: {args.clusters} cluster(s) of 2 workers, "
          f"{'SQLite + ORM broker' if args.sqlite else 'PostgreSQL + Redis broker'}, {cores} CPU cores, "
          f"{args.seconds:g} s a stream, the jobs due every {scale.TICK_S * 1000:g} ms enqueued in one call")
    print(f"{'jobs/s':>8}{'p50 ms':>9}{'p99 ms':>9}   CPU ms per job: " + ", ".join(scale.STREAM_KINDS)
          + "; all; cores used")
    streams = []
    try:
        for _ in range(args.runs):
            for rate in rates:
                measured = scale.measure_latency(args.clusters, rate, args.seconds, project, child_env, out)
                if measured.problems:
                    raise scale.BenchFailure(f"a stream of {rate:g} jobs/s: " + "; ".join(measured.problems))
                spent = {kind: measured.cpu.get(kind, 0.0) for kind in scale.STREAM_KINDS}
                used = sum(spent.values()) / measured.cpu["wall"]
                streams.append((rate, measured.p99, used))
                per_job = [seconds * 1000 / measured.count for seconds in spent.values()]
                print(f"{rate:8.0f}{measured.p50:9.1f}{measured.p99:9.1f}   "
                      + ", ".join(f"{value:.3f}" for value in per_job)
                      + f"; {sum(per_job):.3f}; {used:.2f} ({100 * used / cores:.0f} %)", flush=True)
    except scale.BenchFailure as exc:
        scale._fail(str(exc))
    fixed, per_job = line_fit([(rate, used) for rate, _, used in streams])
    print(f"fit over {len(streams)} streams: cores used = {fixed:.2f} + {per_job * 1000:.3f} ms x jobs/s "
          f"({fixed * scale.TICK_S * 1000:.1f} ms of CPU per {scale.TICK_S * 1000:g} ms tick whatever its jobs, "
          f"{per_job * 1000:.3f} ms per job); {cores} cores are used up at {(cores - fixed) / per_job:.0f} jobs/s"
          if per_job > 0 else f"fit over {len(streams)} streams: no growth with the rate ({fixed:.2f} cores)")
    held = None  # the highest rate up to which every stream kept its p99 under the goal
    for rate in sorted(set(rates)):
        if any(p99 >= P99_GOAL_MS for r, p99, _ in streams if r == rate):
            break
        held = rate
    print(f"p99 under {P99_GOAL_MS:g} ms in every stream up to {held:.0f} jobs/s" if held is not None
          else f"p99 under {P99_GOAL_MS:g} ms not held at {min(rates):.0f} jobs/s")
    print("check: every job of every stream executed exactly once")


if __name__ == "__main__":
    main()
