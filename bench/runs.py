"""End-to-end run throughput and latency on real workers, next to bare django-q2 on the same broker.

    .venv/bin/python bench/runs.py [--db sqlite|postgres] [--runs 40] [--tasks 10000] [--rounds 1]
                                   [--latency-runs 30] [--latency-warmup 3] [--profile]

One ``qcluster`` with 2 workers; ``--db postgres`` uses a scratch PostgreSQL database and the
Redis broker (``BENCH_POSTGRES_URL``, ``BENCH_DATABASE_PREFIX``, ``BENCH_REDIS_URL`` as in
``bench/scale.py``), ``--db sqlite`` the embedded default (SQLite, the ORM broker). Measured in
the same run:

* bare django-q2: ``--tasks`` trivial tasks (``bench.counting.counted``, ``save=False``) on the
  same broker, tasks/s from the first execution to the last (the stack's ceiling), sustained: over
  enough tasks that django-q2 recycles its workers (every 500 tasks) a few times, as it does in a
  long run; the rate over the first 1,000 tasks, before any recycling, is printed apart;
* ``--runs`` runs of a 2 agents × 3 tasks × 2 ``echo`` steps plan, created first and started
  together (``--rounds``: the bare tasks and the batch in turn, that many times; each round's ratio
  is printed, and the figures are the median round's): steps/s from the first ``run_start`` to the last run's ``completed_at``, as a ratio
  to the bare tasks/s; transactions and statements per step over that window (as in
  ``bench/scale.py``: ``pg_stat_database``, the processes' own counts, the ``run_start`` calls
  of the benchmark included, its polling left out; heartbeats and maintenance of the window too);
* the latency of a 1-step run on idle workers: ``run_start`` → ``completed_at``, one run at a
  time, p50 and p99 over ``--latency-runs`` runs, after ``--latency-warmup`` runs on the new
  cluster (its first statements are planned and prepared then: those runs are printed apart);
* ``invariants_check`` at the end.

Exit status 1 (the reason on stderr) when a run does not complete, nothing moves for
``--stall-seconds``, a bare task is lost or runs twice, or an invariant is violated.
``--profile``: one more batch of ``--runs`` runs under ``py-spy record --subprocesses`` (not in
the figures), collapsed stacks to ``bench/out/profile-runs-<db>.folded``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))
from bench import counting  # noqa: E402
from bench._common import (BARE_DJANGO_Q, Window, percentile, pg_stat_statements_note, scratch_database,  # noqa: E402
                           start_cluster, start_profile, stop_cluster, stop_profile, wait_workers)

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")
SHAPE = (2, 3, 2)
STEPS_PER_RUN = SHAPE[0] * SHAPE[1] * SHAPE[2]
TERMINAL = ("completed", "failed", "cancelled")


class BenchFailure(Exception):
    pass


def plan(agents, tasks, steps):
    return {"agents": [{"name": f"a{a}", "tasks": [
        {"name": f"t{t}", "steps": [{"name": f"s{s}", "tool": "echo", "args": {"text": "x"}} for s in range(steps)]}
        for t in range(tasks)]} for a in range(agents)]}


def _cluster(env: dict, log: Path):
    from django.utils import timezone

    since = timezone.now()
    process = start_cluster(env, log)
    try:
        wait_workers(2, since)
    except Exception:
        stop_cluster(process)
        raise
    return process


def bare_rate(n: int, env: dict, out: Path) -> float:
    import redis
    from django.db import connections
    from django_q.tasks import async_task

    redis.Redis.from_url(REDIS_URL).flushdb()
    for index in range(n):
        async_task("bench.counting.counted", index, n, REDIS_URL, save=False)
    connections.close_all()
    process = _cluster({**env, **BARE_DJANGO_Q}, out / "runs-bare.log")
    try:
        counting.wait_counted(REDIS_URL, n, stall_s=STALL_S)
    except TimeoutError as exc:
        raise BenchFailure(f"bare django-q2: {exc}") from exc
    finally:
        stop_cluster(process)
    problems = counting.executions_check(REDIS_URL, range(n))
    if problems:
        raise BenchFailure("bare django-q2: " + "; ".join(problems))
    burst = min(n, counting.MARK)
    print(f"bare django-q2: {counting.counted_rate(REDIS_URL, burst):.0f} tasks/s over its first {burst} tasks "
          "(before a worker is recycled)", flush=True)
    return counting.counted_rate(REDIS_URL, n)


# django-q2 recycles a worker process after 500 tasks (``recycle``, its default, which the bare
# cluster keeps: ``BARE_DJANGO_Q``): with 2 workers the first 1,000 tasks run before any respawn,
# and a rate measured over them is about three times the sustained one. The baseline is the
# sustained rate over ``--tasks`` (10,000 by default); the first 1,000's (``counting.MARK``) is
# printed apart. (Our workers run a drain of up to 200 jobs per django-q2 task, and are recycled
# after 5,000 to 7,500 of them.)


def _wait_runs(ids: list[int], window: Window | None) -> None:
    """Until every run is terminal; fails once no step completed for ``STALL_S``."""
    from runs.models import Run, Step

    def done_and_progress():
        return (Run.objects.filter(pk__in=ids, status__in=TERMINAL).count(),
                Step.objects.filter(run_id__in=ids, status="completed").count())

    last, last_change = None, time.monotonic()
    while True:
        terminal, steps = window.poll(done_and_progress, statements=2) if window else done_and_progress()
        if terminal == len(ids):
            return
        if (terminal, steps) != last:
            last, last_change = (terminal, steps), time.monotonic()
        elif time.monotonic() - last_change > STALL_S:
            raise BenchFailure(f"{terminal} of {len(ids)} runs ended, {steps} steps completed, and nothing moved "
                               f"for {STALL_S:.0f} s; {_stuck(ids)}")
        time.sleep(0.25)


def _stuck(ids: list[int]) -> str:
    """What the runs that did not end hold (at most 3): their nodes' states and their jobs'."""
    from collections import Counter

    from jobs.models import Job
    from runs.models import Agent, Run, Step, Task

    parts = []
    for run in Run.objects.filter(pk__in=ids).exclude(status__in=TERMINAL).order_by("pk")[:3]:
        nodes = {model.__name__.lower(): dict(Counter(model.objects.filter(
            run=run, **({"attempt_number": run.attempt_number} if model is Agent else {})).values_list(
            "status", flat=True))) for model in (Agent, Task, Step)}
        jobs = list(Job.objects.filter(run_id=run.pk).order_by("pk").values_list("pk", "type", "state", "reason",
                                                                                 "attempts", "payload"))
        parts.append(f"run {run.pk} {run.status}: {nodes}; jobs {jobs}")
    return " | ".join(parts) or "every run ended"


def batch(project, count: int, env: dict, out: Path, database_url: str | None, profile: Path | None = None):
    """``count`` runs of SHAPE started together: (steps/s, counts per step)."""
    from django.db import connections
    from django.db.models import Max
    from django.utils import timezone

    from runs import services
    from runs.models import Run

    ids = [services.run_create(project=project, name="bench 2x3x2", plan=plan(*SHAPE)).pk for _ in range(count)]
    connections.close_all()
    window = Window(database_url, REDIS_URL)
    process = _cluster(env, out / f"runs-batch{'-profiled' if profile else ''}.log")
    spy = start_profile(process.pid, profile) if profile else None
    try:
        window.open()
        before = counting.local_counts()
        started = timezone.now()
        for run_id in ids:
            services.run_start(run_id=run_id)
        local = counting.local_counts()
        mine = {key: local[key] - before[key] for key in local}
        _wait_runs(ids, window)
    finally:
        if spy:
            stop_profile(spy)
        stop_cluster(process)
    counts = window.close(count * STEPS_PER_RUN, extra=mine)
    failed = list(Run.objects.filter(pk__in=ids).exclude(status="completed").values_list("pk", "status",
                                                                                       "last_error_code")[:10])
    if failed:
        raise BenchFailure(f"runs not completed (id, status, error): {failed}")
    last = Run.objects.filter(pk__in=ids).aggregate(last=Max("completed_at"))["last"]
    return count * STEPS_PER_RUN / (last - started).total_seconds(), counts


def latency(project, count: int, env: dict, out: Path, warmup: int = 0) -> tuple[float, float, list[float]]:
    """ms from ``run_start`` to ``completed_at`` of 1-step runs, one at a time, on idle workers: p50
    and p99 of ``count`` runs after ``warmup`` runs on the new cluster, and the warm-up runs' own."""
    from django.utils import timezone

    from runs import services
    from runs.models import Run

    process = _cluster(env, out / "runs-latency.log")
    values = []
    try:
        for _ in range(warmup + count):
            run = services.run_create(project=project, name="bench 1x1x1", plan=plan(1, 1, 1))
            time.sleep(0.2)  # idle workers: the previous run's last jobs are done
            started = timezone.now()
            services.run_start(run_id=run.pk)
            deadline = time.monotonic() + STALL_S
            while True:
                status, completed_at = Run.objects.filter(pk=run.pk).values_list("status", "completed_at").get()
                if status in TERMINAL:
                    break
                if time.monotonic() > deadline:
                    raise BenchFailure(f"1-step run {run.pk} still {status} after {STALL_S:.0f} s")
                time.sleep(0.01)
            if status != "completed":
                raise BenchFailure(f"1-step run {run.pk} ended {status}")
            values.append((completed_at - started).total_seconds() * 1000)
    finally:
        stop_cluster(process)
    timed = values[warmup:]
    return percentile(timed, 50), percentile(timed, 99), values[:warmup]


STALL_S = 120.0


def main():
    global STALL_S
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--runs", type=int, default=40, help="runs of 2x3x2 started together (default 40)")
    parser.add_argument("--tasks", type=int, default=10_000,
                        help="bare django-q2 tasks, enough for its workers to be recycled a few times (default 10000)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="bare tasks and a batch of runs, in turn, this many times; the median ratio's round "
                             "is reported (default 1)")
    parser.add_argument("--latency-runs", type=int, default=30, help="1-step runs timed one by one (default 30)")
    parser.add_argument("--latency-warmup", type=int, default=3,
                        help="1-step runs on the new cluster before the timed ones, reported apart (default 3)")
    parser.add_argument("--stall-seconds", type=float, default=120)
    parser.add_argument("--profile", action="store_true",
                        help="one more batch under py-spy (bench/out/profile-runs-<db>.folded)")
    args = parser.parse_args()
    if (args.runs < 1 or args.rounds < 1 or args.tasks < 2 or args.latency_runs < 1 or args.latency_warmup < 0
            or args.stall_seconds <= 0):
        sys.exit("--runs, --rounds and --latency-runs must be at least 1, --tasks at least 2, --latency-warmup at "
                 "least 0, --stall-seconds positive")
    STALL_S = args.stall_seconds
    env = scratch_database(args.db, name="orchestrator_bench_runs")
    env.update({"ORCHESTRATOR_QUEUE_MAX_PER_PROJECT": "1000000", "ORCHESTRATOR_QUEUE_MAX_GLOBAL": "1000000",
                "ORCHESTRATOR_Q_WORKERS": "2", "ORCHESTRATOR_Q_NAME": "bench-runs",
                "DJANGO_SETTINGS_MODULE": "bench.settings"})
    if args.db == "postgres":
        env["REDIS_URL"] = REDIS_URL
    else:
        os.environ.pop("REDIS_URL", None)
        env["ORCHESTRATOR_RATE_LIMIT_STORE"] = "database"
    os.environ.update(env)
    database_url = env.get("DATABASE_URL")
    child_env = {**env, "BENCH_COUNT_URL": REDIS_URL}
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    import logging

    logging.getLogger("orchestrator.transitions").setLevel(logging.WARNING)
    counting.install()  # this process: its run_start calls count with the workers' statements
    from billing.services import organization_create
    from runs.invariants import invariants_check

    _, project, _, _ = organization_create(name="bench", owner_username="bench", credits=10_000_000)
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    load_before = os.getloadavg()[0]
    try:
        rounds = []  # (bare tasks/s, steps/s, counts), bare and batch in turn
        for number in range(1, args.rounds + 1):
            tasks_rate = bare_rate(args.tasks, child_env, out)
            print(f"round {number}: bare django-q2: {tasks_rate:.0f} tasks/s sustained over {args.tasks}", flush=True)
            steps_rate, counts = batch(project, args.runs, child_env, out, database_url)
            print(f"round {number}: batch: {steps_rate:.1f} steps/s (ratio {steps_rate / tasks_rate:.4f})", flush=True)
            rounds.append((tasks_rate, steps_rate, counts))
        # The figures below: the round of the median ratio (the first of two middle ones).
        tasks_rate, steps_rate, counts = sorted(rounds, key=lambda r: r[1] / r[0])[(len(rounds) - 1) // 2]
        p50, p99, warm = latency(project, args.latency_runs, child_env, out, warmup=args.latency_warmup)
        profiled = None
        if args.profile:
            profiled, _ = batch(project, args.runs, env, out, database_url,  # no statement counters
                                profile=out / f"profile-runs-{args.db}.folded")
    except BenchFailure as exc:
        print(f"\nFAILED: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    violations = invariants_check()

    def fmt(value):
        return "-" if value is None else f"{value:.1f}"

    print()
    print(f"database={args.db} broker={'redis' if args.db == 'postgres' else 'orm'} 1 qcluster x 2 workers; "
          f"{os.cpu_count()} CPU cores shared (1-minute load average {load_before:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end)")
    if len(rounds) > 1:
        print(f"{len(rounds)} rounds, ratios " + ", ".join(f"{r[1] / r[0]:.4f} ({r[1]:.1f} / {r[0]:.0f})" for r in rounds)
              + "; the figures below are the median round's")
    print(f"bare django-q2 (trivial task, save=False) : {tasks_rate:8.1f} tasks/s (sustained over {args.tasks} tasks)")
    print(f"{args.runs} runs x {STEPS_PER_RUN} steps (2x3x2 echo), together : {steps_rate:8.1f} steps/s "
          f"({steps_rate / STEPS_PER_RUN:.2f} runs/s); steps/s / bare tasks/s = {steps_rate / tasks_rate:.4f}")
    print(f"per step: transactions {fmt(counts['xact'])} (pg_stat_database) / {fmt(counts['counted_xact'])} "
          f"(counted by the processes), statements {fmt(counts['statements'])} ({counts['statements_source']})")
    if counts["statements_source"] == "counted" and args.db == "postgres":
        print(f"  statements: {pg_stat_statements_note()}")
    print(f"1-step run, run_start -> completed, idle workers ({args.latency_runs} runs): p50 {p50:.0f} ms, "
          f"p99 {p99:.0f} ms" + (f"; the {len(warm)} warm-up runs on the new cluster before them: "
                                 f"{', '.join(f'{value:.0f}' for value in warm)} ms" if warm else ""))
    if profiled:
        print(f"profiled batch (py-spy, not above): {profiled:.1f} steps/s -> bench/out/profile-runs-{args.db}.folded")
    print(f"check_invariants: {len(violations)} violation(s)")
    for violation in violations[:10]:
        print(f"  {violation}")
    if violations:
        print("\nFAILED: invariant violations", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
