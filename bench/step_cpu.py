"""The run engine's cost per step in one process: CPU, wall time and statements, no cluster.

    .venv/bin/python bench/step_cpu.py [--db postgres|sqlite] [--runs 150] [--repeat 1]

Creates ``--runs`` runs of a 2 agents x 3 tasks x 2 ``echo`` steps plan (``bench/runs.py``'s
shape), starts them, and claims and runs their jobs in this process (``jobs_claim`` batches of 8,
``jobs_run_claimed``, as a worker's drain does) until every run completed; prints, per step, this
process's CPU time (``time.process_time``: the worker's Python, the database's share not in it),
on PostgreSQL on this machine the CPU time of the server process serving this connection (read
from ``/proc``: parsing, planning, executing, commits; PostgreSQL's background processes left
out), the wall time and the statements this process sent. The sum of the two CPU times is what a
step costs the machine, the figure that bounds the steps/s of a saturated one. One warm-up batch
of 10 runs goes first (statements prepared, caches filled). ``--repeat``: that many measured batches, each printed. Meant for before/after
comparisons of the step path on a noisy machine: run the two versions in turn, several times.

``--db postgres`` uses a scratch database (``BENCH_POSTGRES_URL``, ``BENCH_DATABASE_PREFIX`` as in
``bench/scale.py``), ``--db sqlite`` a temporary file; nothing else is started (no broker message
is sent: wake messages are dropped).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Running ``bench/step_cpu.py`` puts ``bench/`` first on sys.path, where ``bench/queue.py``
# would shadow the standard library's ``queue``: take the directory off, put the project on.
BENCH_DIR = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH_DIR]
sys.path.insert(0, str(BENCH_DIR.parent))

import argparse  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

from bench._common import cleanup, django_setup, scratch_database  # noqa: E402

SHAPE = (2, 3, 2)
STEPS_PER_RUN = SHAPE[0] * SHAPE[1] * SHAPE[2]


def plan() -> dict:
    agents, tasks, steps = SHAPE
    return {"agents": [{"name": f"a{a}", "tasks": [
        {"name": f"t{t}", "steps": [{"name": f"s{s}", "tool": "echo", "args": {"text": "hi"}} for s in range(steps)]}
        for t in range(tasks)]} for a in range(agents)]}


def batch(project, count: int) -> dict:
    """``count`` runs created, started and driven to completion here: CPU, wall, statements per step."""
    from django.db import connection

    from jobs.executor import jobs_run_claimed
    from jobs.services import jobs_claim
    from jobs.worker import maybe_maintain
    from runs import services
    from runs.models import Run

    ids = [services.run_create(project=project, name="bench step cpu", plan=plan()).pk for _ in range(count)]
    for run_id in ids:
        services.run_start(run_id=run_id)
    sent = [0]

    def counted(execute, sql, params, many, context):
        sent[0] += 1
        return execute(sql, params, many, context)

    server = _server_cpu()
    wall, cpu, server_cpu = time.perf_counter(), time.process_time(), server()
    with connection.execute_wrapper(counted):
        while True:
            maybe_maintain()  # as a worker's drain does between claims: the planner's statistics among it
            claimed = jobs_claim(worker="bench-step-cpu", limit=8)
            if claimed:
                jobs_run_claimed(claimed, worker="bench-step-cpu")
            elif Run.objects.filter(pk__in=ids).exclude(status=Run.Status.COMPLETED).exists():
                time.sleep(0.005)  # a backoff or a retry's not_before: nothing to claim yet
            else:
                break
    wall, cpu, server_cpu = time.perf_counter() - wall, time.process_time() - cpu, server() - server_cpu
    failed = Run.objects.filter(pk__in=ids).exclude(status=Run.Status.COMPLETED).count()
    if failed:
        sys.exit(f"{failed} run(s) did not complete")
    steps = count * STEPS_PER_RUN
    return {"cpu_ms": 1000 * cpu / steps, "server_ms": 1000 * server_cpu / steps if server_cpu == server_cpu else None,
            "wall_ms": 1000 * wall / steps, "statements": sent[0] / steps}


def _server_cpu():
    """A function giving the CPU seconds (user + system) of the PostgreSQL process serving this
    connection so far, or NaN when there is none on this machine to read (SQLite, a remote server)."""
    from django.db import connection

    nothing = lambda: float("nan")  # noqa: E731
    if connection.vendor != "postgresql":
        return nothing
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        path = Path(f"/proc/{cursor.fetchone()[0]}/stat")
    ticks = os.sysconf("SC_CLK_TCK")

    def read() -> float:
        fields = path.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (proc(5), fields 14 and 15)

    try:
        read()
    except (OSError, ValueError, IndexError):
        return nothing
    return read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", choices=["sqlite", "postgres"], default="postgres")
    parser.add_argument("--runs", type=int, default=150, help="runs of 2x3x2 per measured batch (default 150)")
    parser.add_argument("--repeat", type=int, default=1, help="measured batches (default 1)")
    args = parser.parse_args()
    if args.runs < 1 or args.repeat < 1:
        sys.exit("--runs and --repeat must be at least 1")
    env = scratch_database(args.db, name="orchestrator_bench_step_cpu")
    try:
        run(args)
    finally:
        cleanup(env.get("ORCHESTRATOR_SQLITE_PATH"))


def run(args) -> None:
    os.environ.pop("REDIS_URL", None)
    os.environ.update({"ORCHESTRATOR_QUEUE_MAX_PER_PROJECT": "1000000", "ORCHESTRATOR_QUEUE_MAX_GLOBAL": "1000000"})
    django_setup()
    import logging

    logging.getLogger("orchestrator.transitions").setLevel(logging.WARNING)
    import jobs.wake

    jobs.wake._send = lambda count: None  # no broker here: this process claims the jobs itself
    from billing.services import organization_create
    from runs.invariants import invariants_check

    _, project, _, _ = organization_create(name="bench", owner_username="bench", credits=10_000_000)
    batch(project, 10)  # warm-up
    for number in range(1, args.repeat + 1):
        figures = batch(project, args.runs)
        server = "" if figures["server_ms"] is None else (
            f", server CPU {figures['server_ms']:.2f} ms (together {figures['cpu_ms'] + figures['server_ms']:.2f} ms)")
        print(f"batch {number}: {args.runs} runs x {STEPS_PER_RUN} steps ({args.db}): per step CPU "
              f"{figures['cpu_ms']:.2f} ms{server}, wall {figures['wall_ms']:.2f} ms, "
              f"statements {figures['statements']:.1f}", flush=True)
    violations = invariants_check()
    print(f"check_invariants: {len(violations)} violation(s)")
    if violations:
        sys.exit(1)


if __name__ == "__main__":
    main()
