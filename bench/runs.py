"""End-to-end run throughput on real workers, next to the queue's trivial-job rate.

    .venv/bin/python bench/runs.py [--db sqlite|postgres] [--runs 100]

One ``qcluster`` with 2 workers. Measures, in the same run: trivial ``noop`` jobs per second
(the queue's ceiling), runs per second for a 1-agent 1-task 1-step plan, and for a 2 × 3 × 2
plan (12 steps), each from ``run_start`` of a batch to its last completion.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))
from bench._common import scratch_database, start_cluster, stop_cluster, wait_until  # noqa: E402


def plan(agents, tasks, steps):
    return {"agents": [{"name": f"a{a}", "tasks": [
        {"name": f"t{t}", "steps": [{"name": f"s{s}", "tool": "echo", "args": {"text": "x"}} for s in range(steps)]}
        for t in range(tasks)]} for a in range(agents)]}


def runs_per_second(project, shape, count, env, log):
    from runs import services
    from runs.models import Run

    ids = [services.run_create(project=project, name=f"bench {shape}", plan=plan(*shape)).pk for _ in range(count)]
    process = start_cluster(env, log)
    try:
        time.sleep(2)
        start = time.monotonic()
        for run_id in ids:
            services.run_start(run_id=run_id)
        wait_until(lambda: Run.objects.filter(pk__in=ids, status="completed").count() == count, timeout=900,
                   interval=0.2)
        elapsed = time.monotonic() - start
    finally:
        stop_cluster(process)
    failed = Run.objects.filter(pk__in=ids).exclude(status="completed").count()
    return count / elapsed, failed


def noop_per_second(project, count, env, log):
    from jobs.models import Job
    from jobs.services import job_enqueue

    for index in range(count):
        job_enqueue(job_type="noop", project=project, payload={"value": index})
    process = start_cluster(env, log)
    try:
        start = time.monotonic()
        wait_until(lambda: not Job.objects.filter(type="noop").exclude(state="completed").exists(), timeout=600)
        return count / (time.monotonic() - start)
    finally:
        stop_cluster(process)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=1000)
    args = parser.parse_args()
    env = scratch_database(args.db, name="orchestrator_bench_runs")
    env.update({"ORCHESTRATOR_QUEUE_MAX_PER_PROJECT": "1000000", "ORCHESTRATOR_QUEUE_MAX_GLOBAL": "1000000",
                "ORCHESTRATOR_Q_WORKERS": "2", "ORCHESTRATOR_Q_NAME": "bench-runs"})
    import os

    os.environ.update(env)
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    from billing.services import organization_create

    _, project, _, _ = organization_create(name="bench", owner_username="bench", credits=10_000_000)
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    jobs_rate = noop_per_second(project, args.jobs, env, out / "runs-noop.log")
    small, small_failed = runs_per_second(project, (1, 1, 1), args.runs, env, out / "runs-small.log")
    large, large_failed = runs_per_second(project, (2, 3, 2), max(10, args.runs // 4), env, out / "runs-large.log")
    print(f"database={args.db} workers=2")
    print(f"queue noop jobs          : {jobs_rate:7.1f} jobs/s")
    print(f"runs 1x1x1 (1 step)      : {small:7.2f} runs/s  ({small / jobs_rate:.3f} of the noop rate; "
          f"~3 jobs per run){' FAILED ' + str(small_failed) if small_failed else ''}")
    print(f"runs 2x3x2 (12 steps)    : {large:7.2f} runs/s  ({large * 12:.1f} steps/s; "
          f"{large * 12 / jobs_rate:.3f} of the noop rate per step){' FAILED ' + str(large_failed) if large_failed else ''}")


if __name__ == "__main__":
    main()
