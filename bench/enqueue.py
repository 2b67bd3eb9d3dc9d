"""The enqueue call alone: ``jobs_enqueue_many`` of a few jobs, against django-q2's ``async_task``.

    .venv/bin/python bench/enqueue.py [--calls 2000] [--jobs 15] [--rounds 3] [--sqlite] [--profile]

What a producer pays per call and per job, with no worker running: wall time per call (p50, p99)
and this process's CPU per call (``time.process_time``), for our ``jobs_enqueue_many`` of
``--jobs`` ``bench_counted`` jobs (one transaction: the rows, their events, the metric row, the
caps) and, in the same run, for django-q2's ``async_task(..., save=False)`` of as many tasks
onto the same broker (Redis; the ORM broker with ``--sqlite``), the baseline: a producer of bare
django-q2 writes one broker message per task and nothing else. The queue is emptied every 20
calls (not timed): the caps' counts read the few hundred waiting jobs of a queue its workers keep
up with.
Statements per call: those Django's cursors run in 20 more calls (not timed).

Rounds alternate ours and the baseline; the best round of each is printed, with the ratio.
``--profile``: one more pass of ours under ``py-spy record``, collapsed stacks to
``bench/out/profile-enqueue-<db>.folded`` (``bench/profile_top.py`` summarises them).

Needs PostgreSQL (``BENCH_POSTGRES_URL``; scratch database ``orchestrator_bench_enqueue``) and
Redis (``BENCH_REDIS_URL``, default ``redis://127.0.0.1:6379/14``, flushed) unless ``--sqlite``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# bench/ holds a queue.py: keep it off the import path so the standard library's ``queue`` is found.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))
from bench._common import broker_env, percentile, scratch_database, start_profile, stop_profile  # noqa: E402

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")
EMPTY_EVERY = 20


def statements_per_call(project, jobs: int, calls: int = 20) -> float:
    """Statements per ``jobs_enqueue_many`` call, as Django's cursors see them (a pass not timed)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from jobs.services import jobs_enqueue_many

    payloads = [{"value": 0, "total": 0, "redis": REDIS_URL}] * jobs
    with CaptureQueriesContext(connection) as captured:
        for _ in range(calls):
            jobs_enqueue_many(job_type="bench_counted", project=project, payloads=payloads)
    return len(captured.captured_queries) / calls


def measure_ours(project, calls: int, jobs: int) -> dict:
    from jobs.models import Job
    from jobs.services import jobs_enqueue_many

    payloads = [{"value": 0, "total": 0, "redis": REDIS_URL}] * jobs
    walls, cpu = [], 0.0
    for start in range(0, calls, EMPTY_EVERY):
        Job.objects.all().delete()
        for _ in range(min(EMPTY_EVERY, calls - start)):
            before_cpu, before = time.process_time(), time.perf_counter()
            jobs_enqueue_many(job_type="bench_counted", project=project, payloads=payloads)
            walls.append(time.perf_counter() - before)
            cpu += time.process_time() - before_cpu
    return {"walls": walls, "cpu": cpu / calls}


def measure_bare(calls: int, jobs: int) -> dict:
    from django_q.tasks import async_task

    walls, cpu = [], 0.0
    for _ in range(calls):
        before_cpu, before = time.process_time(), time.perf_counter()
        for _ in range(jobs):
            async_task("bench.counting.counted", "k", 0, REDIS_URL, save=False)
        walls.append(time.perf_counter() - before)
        cpu += time.process_time() - before_cpu
    return {"walls": walls, "cpu": cpu / calls}


def _broker_empty() -> None:
    from django_q.brokers import get_broker

    get_broker().purge_queue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--jobs", type=int, default=15, help="jobs per call (default 15: 1,500 jobs/s in calls "
                                                             "every 10 ms, as bench/scale.py's stream)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sqlite", action="store_true", help="the embedded default: SQLite and the ORM broker")
    parser.add_argument("--profile", action="store_true", help="one more pass of ours under py-spy")
    args = parser.parse_args()
    if args.calls < 1 or args.jobs < 1 or args.rounds < 1:
        sys.exit("--calls, --jobs and --rounds must be at least 1")
    env = scratch_database("sqlite" if args.sqlite else "postgres", name="orchestrator_bench_enqueue")
    env.update({"ORCHESTRATOR_Q_NAME": f"bench-enqueue-{os.getpid()}", "DJANGO_SETTINGS_MODULE": "bench.settings",
                "ORCHESTRATOR_QUEUE_MAX_PER_PROJECT": "10000000", "ORCHESTRATOR_QUEUE_MAX_GLOBAL": "10000000"})
    broker_env(env, sqlite=args.sqlite, redis_url=REDIS_URL)
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    import logging

    logging.getLogger("orchestrator.transitions").setLevel(logging.WARNING)
    from billing.services import organization_create
    from django.db import connection

    _, project, _, _ = organization_create(name="bench", owner_username="bench")
    best: dict[str, dict] = {}
    for number in range(1, args.rounds + 1):
        for name, measure in (("ours", lambda: measure_ours(project, args.calls, args.jobs)),
                              ("bare", lambda: measure_bare(args.calls, args.jobs))):
            result = measure()
            _broker_empty()
            p50 = percentile(sorted(result["walls"]), 50) * 1000
            print(f"round {number}: {name}: wall p50 {p50:.2f} ms, CPU {result['cpu'] * 1000:.2f} ms per call of "
                  f"{args.jobs}", flush=True)
            if name not in best or result["cpu"] < best[name]["cpu"]:
                best[name] = result
    if args.profile:
        out = HERE / "out"
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"profile-enqueue-{connection.vendor}.folded"
        profiler = start_profile(os.getpid(), path, rate=200)
        measure_ours(project, args.calls, args.jobs)
        stop_profile(profiler)
        print(f"profile: {path}")
    broker = "the ORM broker" if args.sqlite else "Redis"
    print(f"\ncalls={args.calls} jobs per call={args.jobs} rounds={args.rounds}; {connection.vendor} + {broker}; "
          "best round (least CPU) of each")
    statements = {"ours": statements_per_call(project, args.jobs), "bare": 0.0}
    print(f"{'':40} {'wall p50':>9} {'wall p99':>9} {'CPU/call':>9} {'CPU/job':>8} {'stmt/call':>9}")
    for name, label in (("ours", "ours, jobs_enqueue_many"), ("bare", "bare django-q2, async_task")):
        result = best[name]
        walls = sorted(result["walls"])
        print(f"{label:40} {percentile(walls, 50) * 1000:7.2f}ms {percentile(walls, 99) * 1000:7.2f}ms "
              f"{result['cpu'] * 1000:7.3f}ms {result['cpu'] * 1000 / args.jobs:6.3f}ms {statements[name]:9.1f}")
    print(f"ours / bare django-q2, CPU per call: {best['ours']['cpu'] / best['bare']['cpu']:.2f}")
    connection.close()


if __name__ == "__main__":
    main()
