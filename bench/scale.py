"""Scale-out throughput: jobs/s with 1 and 2 ``qcluster`` processes, next to Celery on the same Redis.

    .venv/bin/python bench/scale.py [--jobs 2000] [--rounds 1] [--no-bare]

Our side: PostgreSQL (a scratch database) and the Redis broker; each cluster runs 2 workers;
``ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY`` is 4 in both cases (``--concurrency``), so the cap
never binds. N ``noop``
jobs are enqueued first (no wake message), then the clusters start and are woken; the rate is
N / (first job started → last job completed), read from the job table, so process start-up
does not count. The outside baseline, in the same run: Celery 5.7 with the same Redis server
(another database number), 1 and 2 worker processes of ``--concurrency 2`` (prefork), running
the same trivial function on N pre-published tasks; each task counts itself in Redis, and the
rate is N / (first task → last task). Bare django-q2 on the same broker runs the same function
the same way (``save=False``: nothing written to PostgreSQL), the same-stack rows. Next to each
rate: how busy the machine's CPUs were from the workers' start to the last job (``/proc/stat``,
every process on the machine), which says whether a second process had any core left to use. Each configuration runs
``--rounds`` times, interleaved; the table shows the best round (the machine is shared) and
every round.

Needs PostgreSQL (``BENCH_POSTGRES_URL``, default ``postgres://postgres@127.0.0.1:5432/postgres``),
Redis (``BENCH_REDIS_URL``, default ``redis://127.0.0.1:6379/14``; flushed) and Celery
(``.venv/bin/pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE_DIR = HERE.parent
# bench/ holds a queue.py: keep it off the import path so the standard library's ``queue`` is found.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != HERE]
sys.path.insert(0, str(BASE_DIR))
from bench._common import start_process, stop_process  # noqa: E402
REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")
# Celery uses the next database number of the same server, so the two never share keys.
_base, _, _db = REDIS_URL.rpartition("/")
CELERY_BROKER_URL = f"{_base}/{(int(_db) + 1) % 16 if _db.isdigit() else 1}"
COUNTER = "bench:scale:done"


def trivial(value):
    """The work of one job: what our ``noop`` job type returns for ``{"value": value}``."""
    return {"echo": value}


_counters: dict = {}


def counted(value, total, redis_url):
    """``trivial``, then count the execution in Redis and stamp the first and the last one.

    The bare django-q2 and Celery baselines run this same function, so they finish the same
    way: the ``total``-th execution marks the end.
    """
    import redis

    trivial(value)
    client = _counters.get(redis_url)
    if client is None:
        client = _counters[redis_url] = redis.Redis.from_url(redis_url)
    done = client.incr(COUNTER)
    if done == 1 or done == total:
        client.set(f"{COUNTER}:{done}", repr(time.time()))


def counted_rate(redis_url: str, n: int, timeout: float) -> float:
    import redis

    client = redis.Redis.from_url(redis_url)
    wait_until(lambda: int(client.get(COUNTER) or 0) >= n, timeout=timeout, interval=0.1)
    first, last = float(client.get(f"{COUNTER}:1")), float(client.get(f"{COUNTER}:{n}"))
    return n / (last - first)


# --- the Celery baseline (this module is also the workers' app: ``-A bench.scale:celery_app``) ----
try:
    from celery import Celery
except ImportError:  # pragma: no cover - reported by main()
    Celery = None

celery_app = None
if Celery is not None:
    celery_app = Celery("bench_scale", broker=CELERY_BROKER_URL)
    celery_app.conf.update(task_ignore_result=True, worker_hijack_root_logger=False,
                           broker_connection_retry_on_startup=True, worker_prefetch_multiplier=4)

    @celery_app.task(name="bench.scale.counted")
    def counted_task(value, total, redis_url):
        counted(value, total, redis_url)


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from ``/proc/stat`` (the whole machine)."""
    with open("/proc/stat") as handle:
        fields = [int(value) for value in handle.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_percent(before: tuple[int, int], after: tuple[int, int]) -> float:
    return 100 * (after[0] - before[0]) / max(1, after[1] - before[1])


def wait_until(predicate, timeout: float, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError("the benchmark did not finish in time")


def measure_ours(clusters: int, n: int, project, env: dict, out: Path) -> tuple[float, float]:
    import redis
    from django.db.models import Max, Min

    from jobs import wake
    from jobs.models import Job
    from jobs.services import job_enqueue

    Job.objects.all().delete()
    redis.Redis.from_url(REDIS_URL).flushdb()
    send = wake._send
    wake._send = lambda count: None  # fill the table first; the clusters are woken once started
    try:
        for index in range(n):
            job_enqueue(job_type="noop", project=project, payload={"value": index})
    finally:
        wake._send = send
    before = cpu_times()
    processes = [start_process([sys.executable, "manage.py", "qcluster"], env, out / f"scale-ours-{clusters}-{i}.log")
                 for i in range(clusters)]
    try:
        wake.wake_workers(2 * clusters, force=True)
        wait_until(lambda: not Job.objects.exclude(state="completed").exists(), timeout=900, interval=0.2)
        after = cpu_times()
    finally:
        for process in processes:
            stop_process(process)
    span = Job.objects.aggregate(first=Min("started_at"), last=Max("completed_at"))
    return n / (span["last"] - span["first"]).total_seconds(), busy_percent(before, after)


def measure_bare(clusters: int, n: int, env: dict, out: Path) -> tuple[float, float]:
    """Bare django-q2 on the same broker: ``counted`` tasks, no result saved (as Celery's)."""
    import redis
    from django_q.tasks import async_task

    redis.Redis.from_url(REDIS_URL).flushdb()
    for index in range(n):
        async_task("bench.scale.counted", index, n, REDIS_URL, save=False)
    before = cpu_times()
    processes = [start_process([sys.executable, "manage.py", "qcluster"], env, out / f"scale-bare-{clusters}-{i}.log")
                 for i in range(clusters)]
    try:
        rate = counted_rate(REDIS_URL, n, timeout=900)
        return rate, busy_percent(before, cpu_times())
    finally:
        for process in processes:
            stop_process(process)


def measure_celery(workers: int, n: int, out: Path) -> tuple[float, float]:
    import redis

    redis.Redis.from_url(CELERY_BROKER_URL).flushdb()
    for index in range(n):
        counted_task.apply_async((index, n, CELERY_BROKER_URL))
    before = cpu_times()
    processes = [start_process([sys.executable, "-m", "celery", "-A", "bench.scale:celery_app", "worker",
                                "-P", "prefork", "-c", "2", "-n", f"bench{i}@%h", "-l", "WARNING",
                                "--without-gossip", "--without-mingle", "--without-heartbeat"],
                               {"BENCH_REDIS_URL": REDIS_URL}, out / f"scale-celery-{workers}-{i}.log")
                 for i in range(workers)]
    try:
        rate = counted_rate(CELERY_BROKER_URL, n, timeout=900)
        return rate, busy_percent(before, cpu_times())
    finally:
        for process in processes:
            stop_process(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-bare", action="store_true", help="skip the bare django-q2 rows")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="our ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY (default 4: every worker of 2 clusters)")
    args = parser.parse_args()
    if celery_app is None:
        sys.exit("Celery is not installed: .venv/bin/pip install -e '.[bench]'")
    if args.jobs < 2 or args.rounds < 1 or args.concurrency < 1:
        sys.exit("--jobs must be at least 2, --rounds and --concurrency at least 1")

    from bench._common import scratch_database

    env = scratch_database("postgres", name="orchestrator_bench_scale")
    env.update({"REDIS_URL": REDIS_URL, "ORCHESTRATOR_Q_WORKERS": "2", "ORCHESTRATOR_Q_NAME": "bench-scale",
                "ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY": str(args.concurrency),
                "ORCHESTRATOR_QUEUE_MAX_PER_PROJECT": "10000000",
                "ORCHESTRATOR_QUEUE_MAX_GLOBAL": "10000000", "ORCHESTRATOR_QUEUE_MAINTENANCE_INTERVAL_MS": "500"})
    os.environ.update(env)
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    import logging

    logging.getLogger("orchestrator.transitions").setLevel(logging.WARNING)  # the workers log theirs to files
    from billing.services import organization_create

    _, project, _, _ = organization_create(name="bench", owner_username="bench")
    out = HERE / "out"
    out.mkdir(parents=True, exist_ok=True)

    rows = [("ours", "our queue (noop jobs), qclusters", lambda c: measure_ours(c, args.jobs, project, env, out))]
    if not args.no_bare:
        rows.append(("bare", "bare django-q2 (same function), qclusters",
                     lambda c: measure_bare(c, args.jobs, env, out)))
    rows.append(("celery", "Celery 5.7, workers of -c 2", lambda c: measure_celery(c, args.jobs, out)))
    rounds: dict[tuple[str, int], list[float]] = {}
    busy: dict[tuple[str, int], list[float]] = {}
    load_before = os.getloadavg()[0]
    for number in range(1, args.rounds + 1):
        for key, name, measure in rows:
            for processes in (1, 2):
                rate, cpu = measure(processes)
                rounds.setdefault((key, processes), []).append(rate)
                busy.setdefault((key, processes), []).append(cpu)
                print(f"round {number}: {name}: {processes}: {rate:.0f}/s, machine CPU busy "
                      f"{busy[(key, processes)][-1]:.0f}%", flush=True)
    best = {key: max(values) for key, values in rounds.items()}

    print()
    print(f"jobs={args.jobs} rounds={args.rounds} global concurrency={args.concurrency}; PostgreSQL + Redis broker; "
          "2 worker processes per qcluster; "
          f"{os.cpu_count()} CPU cores shared with other work (1-minute load average {load_before:.1f} at the "
          f"start, {os.getloadavg()[0]:.1f} at the end); per second, best round")
    print(f"{'':40}{'1 process':>10}{'2 processes':>13}{'2 / 1':>8}   (each round; machine CPU busy, 1 | 2)")
    for key, name, _ in rows:
        one, two = best[(key, 1)], best[(key, 2)]
        each = "; ".join(", ".join(f"{v:.0f}" for v in rounds[(key, p)]) for p in (1, 2))
        cpu = " | ".join(", ".join(f"{v:.0f}%" for v in busy[(key, p)]) for p in (1, 2))
        print(f"{name:40}{one:10.0f}{two:13.0f}{two / one:8.2f}   ({each}; {cpu})")
    print(f"{'ours / Celery':40}{best[('ours', 1)] / best[('celery', 1)]:10.2f}"
          f"{best[('ours', 2)] / best[('celery', 2)]:13.2f}")
    if not args.no_bare:
        print(f"{'ours / bare django-q2':40}{best[('ours', 1)] / best[('bare', 1)]:10.2f}"
              f"{best[('ours', 2)] / best[('bare', 2)]:13.2f}")


if __name__ == "__main__":
    main()
