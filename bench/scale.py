"""Scale-out throughput: jobs/s with 1 and 2 ``qcluster`` processes, next to bare django-q2 and Celery.

    .venv/bin/python bench/scale.py [--jobs 2000] [--rounds 1] [--no-bare] [--latency-seconds 10]
                                    [--sqlite] [--profile]

Our side: PostgreSQL (a scratch database) and the Redis broker; each cluster runs 2 workers;
``ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY`` is 128 in both cases (``--concurrency``): every worker
of 2 clusters with a full claim batch (``ORCHESTRATOR_QUEUE_CLAIM_BATCH``, 32; a claimed batch
counts against the cap until its jobs end), so the cap never binds. Every stack runs the same body, ``bench.counting.counted`` (one Redis round trip
that counts the execution per job id): in our queue as the ``bench_counted`` job type (``noop``'s
definition, registered by the benchmarks' own settings ``bench/settings.py``), in bare django-q2
(``async_task(..., save=False)``, nothing written to the database) and in Celery 5.7 (prefork
workers of ``-c 2``, the same Redis server, the next database number). N jobs are enqueued
first (our wake messages held back and the project's queue paused: a worker's maintenance wakes the
workers for waiting jobs, which started the first cluster while the second was still starting), the
processes start, and once every worker is up the queue is resumed and they are woken: the rate is
N / (first execution → N-th execution), so process start-up does not count.

Printed next to each rate: how busy the machine's CPUs were (``/proc/stat``, every process on the
machine); the ratios ours / bare django-q2, ours / Celery and 2 clusters / 1 cluster;
transactions per job (``pg_stat_database`` commits + rollbacks of the scratch database from the
wake to the processes' exit, the benchmark's own polling taken out) and statements per job
(``pg_stat_statements`` when the server preloads it, else counted by the processes' own cursors,
see ``bench/counting``); both include what the workers do besides jobs in that window
(heartbeats, maintenance, the broker's polling with the ORM broker). Then queued → executing
latency (p50/p99 of ``started_at - queued_at`` of the job rows) of our queue under a steady
stream at 60 % of its measured rate (the jobs due every 10 ms enqueued together), with 1 and 2 clusters
started for it: the stream's first second apart (the new workers' first claims), the rest as the
steady state; the rate the stream reached and the producer's slowest enqueue call are printed next
to it, each job's wait (and worker) written to ``bench/out/latency-<clusters>.tsv``; under it, the
CPU per job of each kind of process over the stream (``/proc``: this process, the producer; the
clusters' processes; every PostgreSQL process; Redis) and the share of the machine's cores they
took, what the stream's rate asks of the machine (a p99 in the tens of ms needs headroom). Beside each
stream, on PostgreSQL, ``bench/commit_probe.py`` commits one row every 10 ms on a connection of its own
and its latencies are printed under the stream's: the floor of a job that is committed queued, then
claimed (a flush of the disk that stalls for 300 ms stalls every enqueue and claim of that moment).
It also runs beside each throughput pass (a commit every ``commit_probe.PASS_PROBE_MS`` ms), printed on the
pass's line: a pass of a few seconds that met a stall of 200 ms shows it.
Before each pass this process's heap is frozen out of the garbage collector's view
(``_collector_quiet``): its own full collections took 100-350 ms of the two cores at moments of their own.

The benchmark FAILS (exit status 1, the reason on stderr) when any job is lost or executed more
than once (the Redis count per job id; for our queue also a job not ``completed`` or with more
than one attempt), or when nothing progresses for ``--stall-seconds``.

``--sqlite``: the embedded default instead, SQLite and the ORM broker, against bare django-q2
on the ORM broker (no Celery); statements and transactions are counted by the processes.
``--profile``: one more one-cluster pass of our queue under ``py-spy record --subprocesses``
(not in the figures), collapsed stacks to ``bench/out/profile-scale-<db>.folded`` (see
``bench/profile_top.py``).

Needs PostgreSQL (``BENCH_POSTGRES_URL``, default ``postgres://postgres@127.0.0.1:5432/postgres``;
``BENCH_DATABASE_PREFIX`` renames the scratch database ``orchestrator_bench_scale``), Redis
(``BENCH_REDIS_URL``, default ``redis://127.0.0.1:6379/14``, and the next database number for
Celery; both flushed) and Celery and py-spy (``.venv/bin/pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE_DIR = HERE.parent
# bench/ holds a queue.py: keep it off the import path so the standard library's ``queue`` is found.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != HERE]
sys.path.insert(0, str(BASE_DIR))
from bench import counting  # noqa: E402
from bench.commit_probe import PASS_PROBE_MS, beside, flushes_text  # noqa: E402
from bench._common import (BARE_DJANGO_Q, ProcessCpu, Window, percentile, pg_stat_statements_note,  # noqa: E402
                           start_process, start_profile, stop_process, stop_profile, stream_kind, wait_workers)

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")
# Celery uses the next database number of the same server, so the two never share keys.
_base, _, _db = REDIS_URL.rpartition("/")
CELERY_BROKER_URL = f"{_base}/{(int(_db) + 1) % 16 if _db.isdigit() else 1}"


class BenchFailure(Exception):
    """A job was lost or ran twice, or the benchmark stalled."""


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
    def counted_task(key, total, redis_url):
        counting.counted(key, total, redis_url)


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from ``/proc/stat`` (the whole machine)."""
    with open("/proc/stat") as handle:
        fields = [int(value) for value in handle.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_percent(before: tuple[int, int], after: tuple[int, int]) -> float:
    return 100 * (after[0] - before[0]) / max(1, after[1] - before[1])


@dataclass
class Result:
    rate: float
    cpu: float
    xact: float | None = None  # per job
    statements: float | None = None  # per job
    counted_xact: float | None = None  # per job, counted by the processes
    problems: list[str] = field(default_factory=list)
    flushes: dict | None = None  # PostgreSQL: the bare commits beside the pass (``bench/commit_probe.py``)


def _wait(predicate, window: Window, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not window.poll(predicate):
        if time.monotonic() > deadline:
            raise BenchFailure(f"jobs not completed {timeout:.0f} s after their last execution")
        time.sleep(0.2)


def _empty_jobs() -> None:
    """Delete every job, then VACUUM ANALYZE the job and event tables on PostgreSQL: each pass starts
    from the table autovacuum would leave (the server may run without it, and the dead rows of
    earlier passes would slow the later ones, whichever is measured)."""
    from django.db import connection
    from jobs.models import Job

    Job.objects.all().delete()
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("VACUUM ANALYZE jobs_job")
            cursor.execute("VACUUM ANALYZE core_event")


def _flush_redis() -> None:
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()


def _jobs_check(ids: list[int], workers: set[str] | None = None) -> list[str]:
    from jobs.models import Job

    problems = []
    if workers is not None:  # every job claimed by a worker of this measure (not a stray process on the database)
        foreign = Job.objects.filter(pk__in=ids).exclude(worker__in=workers)
        if foreign.exists():
            problems.append(f"{foreign.count()} jobs claimed by processes outside the measure "
                            f"(e.g. {sorted(set(foreign.values_list('worker', flat=True)[:100]))[:5]})")
    unfinished = Job.objects.filter(pk__in=ids).exclude(state="completed").count()
    if unfinished:
        problems.append(f"{unfinished} jobs not completed")
    retried = list(Job.objects.filter(pk__in=ids, attempts__gt=1).values_list("pk", "attempts")[:10])
    if retried:
        problems.append(f"jobs claimed more than once (id, attempts): {retried}")
    return problems


def _enqueue(n: int, project, total: int) -> list[int]:
    """Queue ``n`` jobs before the clusters start, a thousand per ``jobs_enqueue_many`` (the wake
    messages held back: the clusters are woken once started)."""
    from jobs import wake
    from jobs.services import jobs_enqueue_many

    send = wake._send
    wake._send = lambda count: None
    try:
        ids = []
        for start in range(0, n, 1000):
            payloads = [{"value": index, "total": total, "redis": REDIS_URL} for index in range(start, min(n, start + 1000))]
            ids.extend(result.job.pk for result in jobs_enqueue_many(job_type="bench_counted", project=project,
                                                                     payloads=payloads))
        return ids
    finally:
        wake._send = send


def _worker_ids(processes: list) -> set[str]:
    """The worker ids (``host:pid``) of the clusters' processes and every process below them."""
    import socket

    from deploy.stack import descendants

    pids = set()
    for process in processes:
        pids |= {process.pid, *descendants(process.pid)}
    return {f"{socket.gethostname()}:{pid}" for pid in pids}


def _start_clusters(clusters: int, env: dict, out: Path, label: str) -> list:
    from django.utils import timezone

    since = timezone.now()
    processes = [start_process([sys.executable, "manage.py", "qcluster"], env, out / f"scale-{label}-{i}.log")
                 for i in range(clusters)]
    try:
        wait_workers(2 * clusters, since, cluster=env["ORCHESTRATOR_Q_NAME"])
    except Exception:
        for process in processes:
            stop_process(process)
        raise
    return processes


@contextmanager
def _workers_running(processes: list, what: str, broker: str, ids=None) -> Iterator[None]:
    """Stops ``processes`` on the way out. A stall (``TimeoutError``) becomes a ``BenchFailure`` that
    names ``what`` and, with ``ids``, which of them ran how often (never, twice ...)."""
    try:
        yield
    except TimeoutError as exc:
        found = "" if ids is None else f"; {'; '.join(counting.executions_check(broker, ids))}"
        raise BenchFailure(f"{what}: {exc}{found}") from exc
    finally:
        for process in processes:
            stop_process(process)


def _collector_quiet() -> None:
    """Before a pass: this process's heap (Django, the jobs it enqueued, the earlier passes'
    results) is collected once and frozen out of the garbage collector's view, as a worker's is at
    its start. Unfrozen, a full collection of it took 100-350 ms of CPU here, at moments of its own
    during a pass (while this process polls, or enqueues the latency stream's jobs, whose waits
    had begun), on the two cores the measured processes share."""
    gc.collect()
    gc.freeze()


def measure_ours(clusters: int, n: int, project, env: dict, out: Path, database_url: str | None,
                 profile: Path | None = None) -> Result:
    from jobs import wake
    from jobs.models import Job
    from jobs.services import queue_pause, queue_resume

    _empty_jobs()
    _flush_redis()
    # The project's queue is paused until every cluster is up: a worker's maintenance wakes the
    # workers for waiting jobs, so the first cluster would otherwise start on them while the second
    # one is still starting (and compete with its start-up for the CPU).
    queue_pause(project_id=project.pk, actor=None, reason="benchmark: until every cluster is up")
    ids = _enqueue(n, project, n)
    _collector_quiet()
    window = Window(database_url, REDIS_URL)
    processes = _start_clusters(clusters, env, out, f"ours-{clusters}")
    spy = start_profile(processes[0].pid, profile) if profile else None
    with _workers_running(processes, f"our queue, {clusters} cluster(s)", REDIS_URL, ids), \
            beside(PASS_PROBE_MS, timeout=STALL_S) as flushes:
        try:
            window.open()
            before = cpu_times()
            queue_resume(project_id=project.pk, actor=None, reason="benchmark: every cluster is up")
            wake.wake_workers(2 * clusters, force=True)
            counting.wait_counted(REDIS_URL, n, stall_s=STALL_S)
            after = cpu_times()
            workers = _worker_ids(processes)
            if spy:
                stop_profile(spy)
            _wait(lambda: not Job.objects.filter(pk__in=ids).exclude(state="completed").exists(), window, STALL_S)
        finally:
            if spy:
                stop_profile(spy)
    counts = window.close(n)
    problems = counting.executions_check(REDIS_URL, ids) + _jobs_check(ids, workers)
    return Result(counting.counted_rate(REDIS_URL, n), busy_percent(before, after), counts["xact"],
                  counts["statements"], counts["counted_xact"], problems, flushes or None)


def measure_bare(clusters: int, n: int, env: dict, out: Path, database_url: str | None) -> Result:
    """Bare django-q2 on the same broker: ``counted`` tasks, no result saved (as Celery's)."""
    from django.db import connections
    from django_q.tasks import async_task

    _flush_redis()
    for index in range(n):
        async_task("bench.counting.counted", index, n, REDIS_URL, save=False)
    connections.close_all()
    _collector_quiet()
    window = Window(database_url, REDIS_URL)
    # The broker's messages wait in Redis (or the ORM table); the workers take them once started.
    processes = _start_clusters(clusters, {**env, **BARE_DJANGO_Q}, out, f"bare-{clusters}")
    with _workers_running(processes, f"bare django-q2, {clusters} cluster(s)", REDIS_URL, range(n)), \
            beside(PASS_PROBE_MS, timeout=STALL_S) as flushes:
        window.open()
        before = cpu_times()
        counting.wait_counted(REDIS_URL, n, stall_s=STALL_S)
        after = cpu_times()
    counts = window.close(n)
    return Result(counting.counted_rate(REDIS_URL, n), busy_percent(before, after), counts["xact"],
                  counts["statements"], counts["counted_xact"], counting.executions_check(REDIS_URL, range(n)),
                  flushes or None)


def measure_celery(workers: int, n: int, out: Path) -> Result:
    import redis

    redis.Redis.from_url(CELERY_BROKER_URL).flushdb()
    for index in range(n):
        counted_task.apply_async((index, n, CELERY_BROKER_URL))
    _collector_quiet()
    before = cpu_times()
    processes = [start_process([sys.executable, "-m", "celery", "-A", "bench.scale:celery_app", "worker",
                                "-P", "prefork", "-c", "2", "-n", f"bench{i}@%h", "-l", "WARNING",
                                "--without-gossip", "--without-mingle", "--without-heartbeat"],
                               {"BENCH_REDIS_URL": REDIS_URL}, out / f"scale-celery-{workers}-{i}.log")
                 for i in range(workers)]
    with _workers_running(processes, f"Celery, {workers} worker(s)", CELERY_BROKER_URL):
        counting.wait_counted(CELERY_BROKER_URL, n, stall_s=STALL_S)
        after = cpu_times()
    return Result(counting.counted_rate(CELERY_BROKER_URL, n), busy_percent(before, after),
                  problems=counting.executions_check(CELERY_BROKER_URL, range(n)))


# The stream is enqueued every ``TICK_S`` by one producer thread (its own connection), the jobs due
# in that tick in one ``jobs_enqueue_many`` call: one process enqueueing a job per call falls behind
# at a few hundred jobs/s, while a tick's batch keeps up with the queue's full rate.
TICK_S = 0.01


def _produce(rate: float, seconds: float, project, calls: list | None = None, close: bool = True) -> list[int]:
    """Enqueue ``rate`` jobs/s for ``seconds``, the jobs due every ``TICK_S`` together; the ids
    enqueued. ``calls`` receives each ``jobs_enqueue_many`` call's (start in s, duration in ms):
    a job's wait counts from its ``queued_at``, set before the call commits."""
    from django.db import connection
    from jobs.services import jobs_enqueue_many
    from jobs.services.enqueue import ENQUEUE_MANY_MAX

    ids: list[int] = []
    started = time.monotonic()
    end = started + seconds
    next_at = started
    try:
        while next_at < end:
            time.sleep(max(0.0, next_at - time.monotonic()))
            due = int(rate * min(end, time.monotonic()) - rate * started) - len(ids)
            while due > 0:  # after a stall of the producer, what fell due in calls of at most ENQUEUE_MANY_MAX
                payloads = [{"value": 0, "total": 0, "redis": REDIS_URL}] * min(due, ENQUEUE_MANY_MAX)
                call = time.monotonic()
                ids.extend(result.job.pk for result in jobs_enqueue_many(
                    job_type="bench_counted", project=project, payloads=payloads))
                if calls is not None:
                    calls.append((call - started, (time.monotonic() - call) * 1000))
                due -= len(payloads)
            next_at += TICK_S
    finally:
        if close:
            connection.close()
    return ids


# The kinds of process a stream's CPU is counted for (``stream_kind``), in the order they are printed.
STREAM_KINDS = ("producer", "workers", "database", "Redis")

# The stream's first second is reported apart: it holds the new workers' first claims (a new
# process's first statements, its first job), which a long-running cluster pays once per process.
FIRST_S = 1.0


@dataclass
class Latency:
    p50: float  # ms, the jobs queued after the stream's first second
    p99: float
    first_p99: float  # ms, the jobs of the first second
    count: int
    problems: list
    slowest_enqueue: float  # ms, the producer's slowest enqueue call
    commits: dict | None = None  # PostgreSQL: the bare commits beside the stream (``bench/commit_probe.py``)
    cpu: dict | None = None  # CPU seconds per kind of process over the stream (``ProcessCpu``), and its wall time


def measure_latency(clusters: int, rate: float, seconds: float, project, env: dict, out: Path) -> Latency:
    """p50/p99 of queued → executing (ms) under a steady stream of ``rate`` jobs/s (the first
    ``FIRST_S`` apart); also the rate the producers reached and the CPU per kind of process."""
    from django.db import connection

    from jobs.models import Job

    _empty_jobs()
    _flush_redis()
    processes = _start_clusters(clusters, env, out, f"latency-{clusters}")
    ids: list[int] = []
    calls: list[tuple[float, float]] = []
    _collector_quiet()
    cpu = ProcessCpu()
    with _workers_running(processes, f"latency, {clusters} cluster(s)", REDIS_URL, ids):
        with beside(10, seconds, timeout=STALL_S) as commits:  # the floor: a bare commit on the same server, meanwhile
            cpu.start()
            ids.extend(_produce(rate, seconds, project, calls, close=False))
        counting.wait_counted(REDIS_URL, len(ids), stall_s=STALL_S)
        spent = cpu.stop(stream_kind(processes))  # the producer's connection still open: its backend counts
        connection.close()
        deadline = time.monotonic() + STALL_S
        while Job.objects.filter(pk__in=ids).exclude(state="completed").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    problems = counting.executions_check(REDIS_URL, ids) + _jobs_check(ids)
    rows = list(Job.objects.filter(pk__in=ids).values_list("queued_at", "started_at", "worker"))
    _waits_dump(out / f"latency-{clusters}.tsv", rows)
    with (out / f"latency-{clusters}-producer.tsv").open("w") as handle:
        handle.writelines(f"{at:.3f}\t{duration:.1f}\n" for at, duration in calls)
    first = min((queued for queued, _, _ in rows), default=None)
    early, steady = [], []
    for queued, started, _ in rows:
        wait = (started - queued).total_seconds() * 1000
        (early if (queued - first).total_seconds() < FIRST_S else steady).append(wait)
    steady = steady or early
    return Latency(percentile(steady, 50), percentile(steady, 99), percentile(early, 99) if early else 0.0,
                   len(ids), problems, max([duration for _, duration in calls] or [0.0]), commits or None, spent)



def _waits_dump(path: Path, rows: list) -> None:
    """Each job of the stream: seconds since the stream's first job, its wait (ms), its worker."""
    if not rows:
        return
    first = min(queued for queued, _, _ in rows)
    with path.open("w") as handle:
        handle.write(f"# seconds since {first.isoformat()}, wait ms, worker\n")
        for queued, started, worker in sorted(rows):
            handle.write(f"{(queued - first).total_seconds():.3f}\t{(started - queued).total_seconds() * 1000:.1f}\t{worker}\n")


STALL_S = 60.0


def _fail(message: str) -> None:
    print(f"\nFAILED: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def prepare(*, sqlite: bool, concurrency: int) -> tuple[dict, dict, object]:
    """The scratch database (migrated, with one organization's project), this process pointed at
    it, and the environment of the clusters' processes: ``(env, child_env, project)``. Each cluster
    runs 2 workers under a queue name of this run's own (a stray cluster left on the same broker
    never takes its messages), the caps on waiting jobs out of the way, ``concurrency`` executing."""
    from bench._common import broker_env, scratch_database

    env = scratch_database("sqlite" if sqlite else "postgres", name="orchestrator_bench_scale")
    env.update({"ORCHESTRATOR_Q_WORKERS": "2", "ORCHESTRATOR_Q_NAME": f"bench-scale-{os.getpid()}",
                "ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY": str(concurrency),
                "ORCHESTRATOR_QUEUE_MAX_PER_PROJECT": "10000000",
                "ORCHESTRATOR_QUEUE_MAX_GLOBAL": "10000000", "ORCHESTRATOR_QUEUE_MAINTENANCE_INTERVAL_MS": "500",
                "DJANGO_SETTINGS_MODULE": "bench.settings"})
    broker_env(env, sqlite=sqlite, redis_url=REDIS_URL)
    child_env = {**env, "BENCH_COUNT_URL": REDIS_URL}
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    import logging

    logging.getLogger("orchestrator.transitions").setLevel(logging.WARNING)  # the workers log theirs to files
    from billing.services import organization_create

    _, project, _, _ = organization_create(name="bench", owner_username="bench")
    return env, child_env, project


def main() -> None:
    global STALL_S
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-bare", action="store_true", help="skip the bare django-q2 rows")
    parser.add_argument("--concurrency", type=int, default=128,
                        help="our ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY (default 128: every worker of 2 clusters "
                             "holding a full claim batch of 32)")
    parser.add_argument("--latency-seconds", type=float, default=10,
                        help="length of the steady stream of the latency measure (0: skip it)")
    parser.add_argument("--latency-rate", type=float, default=0,
                        help="jobs/s of the latency measure's stream (default 0: 60%% of the rate measured)")
    parser.add_argument("--stall-seconds", type=float, default=60,
                        help="fail when no job executes for this long (default 60)")
    parser.add_argument("--sqlite", action="store_true",
                        help="the embedded default: SQLite and the ORM broker, against bare django-q2 on it")
    parser.add_argument("--profile", action="store_true",
                        help="one more one-cluster pass of our queue under py-spy (bench/out/profile-scale-*.folded)")
    args = parser.parse_args()
    if celery_app is None and not args.sqlite:
        sys.exit("Celery is not installed: .venv/bin/pip install -e '.[bench]'")
    if args.jobs < 2 or args.rounds < 1 or args.concurrency < 1 or args.stall_seconds <= 0:
        sys.exit("--jobs must be at least 2, --rounds and --concurrency at least 1, --stall-seconds positive")
    STALL_S = args.stall_seconds

    env, child_env, project = prepare(sqlite=args.sqlite, concurrency=args.concurrency)
    database_url = env.get("DATABASE_URL")
    out = HERE / "out"
    out.mkdir(parents=True, exist_ok=True)
    db_label = "sqlite" if args.sqlite else "postgres"

    rows = [("ours", "our queue, qclusters",
             lambda c: measure_ours(c, args.jobs, project, child_env, out, database_url))]
    if not args.no_bare:
        rows.append(("bare", "bare django-q2, qclusters",
                     lambda c: measure_bare(c, args.jobs, child_env, out, database_url)))
    if not args.sqlite:
        rows.append(("celery", "Celery 5.7, workers of -c 2", lambda c: measure_celery(c, args.jobs, out)))
    results: dict[tuple[str, int], list[Result]] = {}
    load_before = os.getloadavg()[0]
    try:
        for number in range(1, args.rounds + 1):
            for key, name, measure in rows:
                for processes in (1, 2):
                    result = measure(processes)
                    results.setdefault((key, processes), []).append(result)
                    print(f"round {number}: {name}: {processes}: {result.rate:.0f}/s, machine CPU busy "
                          f"{result.cpu:.0f}%{flushes_text(result.flushes)}", flush=True)
                    if result.problems:
                        _fail(f"{name}, {processes}: " + "; ".join(result.problems))
        latency = {}
        if args.latency_seconds > 0:
            for processes in (1, 2):
                stream = args.latency_rate or max(5.0, 0.6 * max(r.rate for r in results[("ours", processes)]))
                measured = measure_latency(processes, stream, args.latency_seconds, project, child_env, out)
                if measured.problems:
                    _fail(f"latency, {processes} cluster(s): " + "; ".join(measured.problems))
                latency[processes] = (stream, measured)
        profiled = None
        if args.profile:
            profile = out / f"profile-scale-{db_label}.folded"
            # Without the statement counters: the profile shows the code as it runs in production.
            profiled = measure_ours(1, args.jobs, project, env, out, database_url, profile=profile)
            if profiled.problems:
                _fail("profiled pass: " + "; ".join(profiled.problems))
    except BenchFailure as exc:
        _fail(str(exc))
    best = {key: max(values, key=lambda r: r.rate) for key, values in results.items()}

    def fmt(value, spec=".1f"):
        return "-" if value is None else format(value, spec)

    print()
    print(f"jobs={args.jobs} rounds={args.rounds} global concurrency={args.concurrency}; "
          f"{'SQLite + ORM broker' if args.sqlite else 'PostgreSQL + Redis broker'}; 2 worker processes per "
          f"qcluster; {os.cpu_count()} CPU cores shared with other work (1-minute load average "
          f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end); per second, best round")
    print(f"{'':32}{'1 proc':>8}{'2 procs':>9}{'2 / 1':>7}  {'xact/job 1|2':>13}  {'stmt/job 1|2':>13}  "
          f"(each round; machine CPU busy 1 | 2)")
    for key, name, _ in rows:
        one, two = best[(key, 1)], best[(key, 2)]
        each = "; ".join(", ".join(f"{r.rate:.0f}" for r in results[(key, p)]) for p in (1, 2))
        cpu = " | ".join(", ".join(f"{r.cpu:.0f}%" for r in results[(key, p)]) for p in (1, 2))
        xact = one.xact if not args.sqlite else one.counted_xact
        xact2 = two.xact if not args.sqlite else two.counted_xact
        print(f"{name:32}{one.rate:8.0f}{two.rate:9.0f}{two.rate / one.rate:7.2f}  "
              f"{fmt(xact):>6}|{fmt(xact2):<6}  {fmt(one.statements):>6}|{fmt(two.statements):<6}  ({each}; {cpu})")
    for other, label in (("bare", "bare django-q2"), ("celery", "Celery")):
        if (other, 1) in best:
            print(f"{'ours / ' + label:32}{best[('ours', 1)].rate / best[(other, 1)].rate:8.3f}"
                  f"{best[('ours', 2)].rate / best[(other, 2)].rate:9.3f}")
    ours1, ours2 = best[("ours", 1)], best[("ours", 2)]
    if args.sqlite:
        print("transactions: counted by the processes (commits and rollbacks of atomic blocks + autocommit "
              "statements); statements: counted by the processes' cursors")
    else:
        print(f"transactions: pg_stat_database commits + rollbacks over the window (counted by the processes: "
              f"ours {fmt(ours1.counted_xact)}|{fmt(ours2.counted_xact)} per job); statements: "
              + (pg_stat_statements_note() or "pg_stat_statements calls"))
    for processes, (stream, measured) in latency.items():
        print(f"queued -> executing, our queue, {processes} cluster(s), a stream of {stream:.0f} jobs/s for "
              f"{args.latency_seconds:.0f} s ({measured.count} jobs, {measured.count / args.latency_seconds:.0f}/s "
              f"reached): p50 {measured.p50:.1f} ms, p99 {measured.p99:.1f} ms after its first {FIRST_S:.0f} s; "
              f"p99 {measured.first_p99:.1f} ms in it (the new workers' first claims); the producer's slowest "
              f"enqueue call {measured.slowest_enqueue:.0f} ms; each job's wait in bench/out/latency-{processes}.tsv")
        if measured.cpu and measured.count:
            cpu, wall = {k: measured.cpu[k] for k in STREAM_KINDS if measured.cpu.get(k)}, measured.cpu["wall"]
            print("    CPU per job over the stream and its backlog's end (/proc): " + ", ".join(
                f"{kind} {seconds * 1000 / measured.count:.3f} ms" for kind, seconds in cpu.items())
                + f"; {sum(cpu.values()) * 1000 / measured.count:.3f} ms in all, "
                f"{100 * sum(cpu.values()) / wall / (os.cpu_count() or 1):.0f} % of the machine's cores")
        if measured.commits:
            c = measured.commits
            print(f"    beside it, a bare PostgreSQL commit of one row every 10 ms (the floor of any job that is "
                  f"committed queued, then claimed): p50 {c['p50']:.1f} ms, p99 {c['p99']:.1f} ms, "
                  f"max {c['max']:.0f} ms, {c['over_20_ms']} of {c['count']} over 20 ms")
    if profiled:
        print(f"profiled pass (py-spy, 1 cluster, not in the table): {profiled.rate:.0f} jobs/s -> "
              f"bench/out/profile-scale-{db_label}.folded")
    print("check: every job executed exactly once (Redis count per job id; our jobs completed, one attempt each)")


if __name__ == "__main__":
    main()
