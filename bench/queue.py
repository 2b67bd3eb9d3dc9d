"""Queue throughput and latency: our job queue vs. bare django-q2 on the same broker and database.

    .venv/bin/python bench/queue.py [--jobs 2000] [--db sqlite|postgres] [--broker orm|redis]

Both sides run a trivial function with one ``qcluster`` of 2 workers. Throughput: N jobs
enqueued first, then the cluster drains them (jobs/s from cluster start to the last result).
Latency: a steady stream at ~60 % of the measured rate, p50/p99 of queued → executing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# This file is named like the standard library's ``queue``: take bench/ off the import path so
# ``import queue`` (multiprocessing, django-q2) finds the real one, and load our helpers by path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
import importlib.util  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_common", _HERE / "_common.py")
_common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_common)
percentile, scratch_database, start_cluster, stop_cluster, wait_until = (
    _common.percentile, _common.scratch_database, _common.start_cluster, _common.stop_cluster, _common.wait_until)


def measure_bare(n: int, env: dict, log: Path) -> float:
    from django_q.models import OrmQ, Task
    from django_q.tasks import async_task

    Task.objects.all().delete()
    for _ in range(n):
        async_task("math.floor", 1.5)
    # django-q2 keeps at most ``save_limit`` results: keep them all, or the count never reaches n.
    process = start_cluster({**env, "ORCHESTRATOR_Q_SAVE_LIMIT": str(max(n, 1000))}, log)
    try:
        start = time.monotonic()
        wait_until(lambda: Task.objects.count() >= n, timeout=600, interval=0.1)
        elapsed = time.monotonic() - start
    finally:
        stop_cluster(process)
    OrmQ.objects.all().delete()
    return n / elapsed


def measure_ours(n: int, env: dict, log: Path, project) -> float:
    from jobs.models import Job
    from jobs.services import job_enqueue

    Job.objects.all().delete()
    for index in range(n):
        job_enqueue(job_type="noop", project=project, payload={"value": index})
    process = start_cluster(env, log)
    try:
        start = time.monotonic()
        wait_until(lambda: not Job.objects.exclude(state="completed").exists(), timeout=600, interval=0.1)
        elapsed = time.monotonic() - start
    finally:
        stop_cluster(process)
    return n / elapsed


def measure_latency(rate: float, seconds: float, env: dict, log: Path, project) -> tuple[float, float, int]:
    from jobs.models import Job
    from jobs.services import job_enqueue

    Job.objects.all().delete()
    process = start_cluster(env, log)
    try:
        time.sleep(3)  # let the workers start
        interval = 1.0 / rate
        next_at = time.monotonic()
        end = next_at + seconds
        count = 0
        while time.monotonic() < end:
            job_enqueue(job_type="noop", project=project, payload={"value": count})
            count += 1
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))
        wait_until(lambda: not Job.objects.exclude(state="completed").exists(), timeout=300, interval=0.1)
    finally:
        stop_cluster(process)
    waits = [(started - queued).total_seconds() * 1000
             for queued, started in Job.objects.values_list("queued_at", "started_at")]
    return percentile(waits, 50), percentile(waits, 99), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--broker", choices=["orm", "redis"], default="orm")
    parser.add_argument("--latency-seconds", type=float, default=10)
    args = parser.parse_args()

    env = scratch_database(args.db)
    env.update({"ORCHESTRATOR_QUEUE_MAX_PER_PROJECT": "1000000", "ORCHESTRATOR_QUEUE_MAX_GLOBAL": "1000000",
                "ORCHESTRATOR_Q_WORKERS": "2", "ORCHESTRATOR_Q_NAME": "bench"})
    if args.broker == "redis":
        env["REDIS_URL"] = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")
    os.environ.update(env)
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    if args.broker == "redis":
        import redis

        redis.Redis.from_url(env["REDIS_URL"]).flushdb()
    from billing.services import organization_create

    _, project, _, _ = organization_create(name="bench", owner_username="bench")
    logs = Path(__file__).resolve().parent / "out"
    logs.mkdir(parents=True, exist_ok=True)

    bare = measure_bare(args.jobs, env, logs / "queue-bare.log")
    ours = measure_ours(args.jobs, env, logs / "queue-ours.log", project)
    p50, p99, streamed = measure_latency(max(5.0, ours * 0.6), args.latency_seconds, env,
                                         logs / "queue-latency.log", project)
    print(f"database={args.db} broker={args.broker} workers=2 jobs={args.jobs}")
    print(f"bare django-q2 async_task : {bare:8.1f} tasks/s")
    print(f"our queue (noop jobs)     : {ours:8.1f} jobs/s")
    print(f"ratio ours / bare         : {ours / bare:8.2f}")
    print(f"queued->executing at {max(5.0, ours * 0.6):.0f} jobs/s for {args.latency_seconds:.0f}s "
          f"({streamed} jobs): p50 {p50:.1f} ms, p99 {p99:.1f} ms")


if __name__ == "__main__":
    main()
