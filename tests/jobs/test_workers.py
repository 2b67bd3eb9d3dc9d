"""Real processes: concurrent dedupe, exactly-once claims, and recovery after kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import Counter

import pytest
from django.db import connection

from core.models import Event
from jobs.models import TERMINAL_JOB_STATES, Job, JobState, WorkerHeartbeat
from jobs.registry import Dedupe
from jobs.services import job_enqueue
from tests.processes import BASE_DIR, Cluster, flush_redis, redis_available, wait_for, worker_env

pytestmark = pytest.mark.django_db(transaction=True)

# START_GATE: a directory where each process says it is ready, then waits for the others, so
# all of them claim from the start (one slow to start would otherwise find the queue drained).
DRAIN_LOOP = """
import django, os, pathlib, time
django.setup()
from django.db import connection
from jobs.tasks import drain
from jobs.models import Job
connection.ensure_connection()
gate = pathlib.Path(os.environ["START_GATE"])
(gate / str(os.getpid())).touch()
deadline = time.monotonic() + 60
while len(list(gate.iterdir())) < int(os.environ["START_GATE_COUNT"]) and time.monotonic() < deadline:
    time.sleep(0.01)
idle = 0
while idle < 20:
    idle = idle + 1 if drain() == 0 else 0
    time.sleep(0.02)
"""


@pytest.mark.postgres
def test_concurrent_single_flight_enqueues_create_one_job(project, define_job, monkeypatch):
    monkeypatch.setattr("jobs.wake._send", lambda count: None)
    define_job(type="suggest", run=lambda ctx, p: None, priority_class="interactive",
               dedupe=Dedupe("single_flight", key=lambda p, pid: "same"))
    # 100 enqueues from 50 threads released together (a thread holds a connection, and the
    # server's default max_connections is 100).
    barrier = threading.Barrier(50)
    answers, errors = [], []

    def enqueue():
        try:
            barrier.wait()
            for _ in range(2):
                result = job_enqueue(job_type="suggest", project=project, payload={})
                answers.append((result.job.pk, result.dedupe))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=enqueue) for _ in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert Job.objects.filter(type="suggest").count() == 1
    assert len({job_id for job_id, _ in answers}) == 1
    assert Counter(kind for _, kind in answers) == {"enqueued": 1, "already_queued": 99}


@pytest.mark.postgres
@pytest.mark.slow
def test_four_worker_processes_execute_every_job_exactly_once(project, monkeypatch, tmp_path):
    monkeypatch.setattr("jobs.wake._send", lambda count: None)
    monkeypatch.setenv("ORCHESTRATOR_QUEUE_MAX_PER_PROJECT", "100000")
    from django.conf import settings

    monkeypatch.setattr(settings, "ORCHESTRATOR_QUEUE_MAX_PER_PROJECT", 100_000)
    monkeypatch.setattr(settings, "ORCHESTRATOR_QUEUE_MAX_GLOBAL", 100_000)
    ids = {job_enqueue(job_type="probe", project=project, payload={"value": n}).job.pk for n in range(2000)}
    env = worker_env(ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY=4)
    workers = [subprocess.Popen([sys.executable, "-c", DRAIN_LOOP], cwd=BASE_DIR,
                                env={**env, "DJANGO_SETTINGS_MODULE": "orchestrator_site.settings",
                                     "START_GATE": str(tmp_path), "START_GATE_COUNT": "4"})
               for _ in range(4)]
    try:
        for process in workers:
            assert process.wait(timeout=240) == 0
    finally:
        for process in workers:
            if process.poll() is None:
                process.kill()
    executions = Counter(Event.objects.filter(type="job_probe_executed").values_list("payload__jobId", flat=True))
    lost = ids - set(executions)
    duplicated = {job_id for job_id, count in executions.items() if count > 1}
    unexpected = set(executions) - ids
    assert (len(lost), len(duplicated), len(unexpected)) == (0, 0, 0)
    assert Job.objects.filter(pk__in=ids, state=JobState.COMPLETED).count() == 2000
    workers_used = Counter(Event.objects.filter(type="job_probe_executed").values_list("payload__worker", flat=True))
    assert len(workers_used) == 4  # the work really was spread


def _kill_busy_workers(times: int) -> list[str]:
    """kill -9 worker processes while they execute a job; returns the killed workers' ids."""
    killed: list[str] = []
    for _ in range(times):
        beat = wait_for(lambda: WorkerHeartbeat.objects.filter(current_job_id__isnull=False)
                        .exclude(worker__in=killed).first(), timeout=30, message="a busy worker")
        try:
            os.kill(int(beat.worker.rsplit(":", 1)[1]), signal.SIGKILL)
            killed.append(beat.worker)
        except ProcessLookupError:
            continue
    return killed


def _recovery_drill(project, tmp_path, **cluster_env):
    jobs = [job_enqueue(job_type="probe", project=project, payload={"value": n, "sleep": 0.4}).job.pk
            for n in range(24)]
    with Cluster(tmp_path / "qcluster.log", **cluster_env):
        killed = _kill_busy_workers(3)
        wait_for(lambda: Job.objects.filter(pk__in=jobs, state__in=list(TERMINAL_JOB_STATES)).count() == len(jobs),
                 timeout=120, interval=0.3, message="every job terminal")
    states = Counter(Job.objects.filter(pk__in=jobs).values_list("state", flat=True))
    assert states == {JobState.COMPLETED: len(jobs)}, (states, (tmp_path / "qcluster.log").read_text()[-3000:])
    runs = Event.objects.filter(type="job_probe_executed").values_list("payload__jobId", "payload__worker")
    executions = Counter(job_id for job_id, _ in runs)
    assert set(executions) == set(jobs)  # none lost
    twice = {job_id for job_id, count in executions.items() if count > 1}
    assert len(twice) <= len(killed)
    for job_id in twice:  # only a job whose worker was killed mid-way ran again
        assert {worker for j, worker in runs if j == job_id} & set(killed)
        assert Job.objects.get(pk=job_id).attempts >= 2


@pytest.mark.slow
def test_recovery_after_kill_9_with_the_orm_broker(project, tmp_path):
    _recovery_drill(project, tmp_path, ORCHESTRATOR_Q_NAME="recovery-orm")


@pytest.mark.slow
@pytest.mark.skipif(not redis_available(), reason="needs Redis at REDIS_TEST_URL (redis://127.0.0.1:6379/15)")
def test_recovery_after_kill_9_with_the_redis_broker(project, tmp_path):
    from tests.processes import REDIS_TEST_URL

    flush_redis()
    _recovery_drill(project, tmp_path, ORCHESTRATOR_Q_NAME="recovery-redis", REDIS_URL=REDIS_TEST_URL)


@pytest.mark.slow
def test_stopping_a_cluster_is_bounded_and_loses_nothing(project, tmp_path):
    import time

    jobs = [job_enqueue(job_type="probe", project=project, payload={"value": n, "sleep": 0.5}).job.pk
            for n in range(30)]
    cluster = Cluster(tmp_path / "first.log", ORCHESTRATOR_Q_NAME="stop-drain", ORCHESTRATOR_QUEUE_DRAIN_MAX_S=2)
    cluster.start()
    try:
        wait_for(lambda: Job.objects.filter(pk__in=jobs, state=JobState.COMPLETED).count() >= 2, timeout=60,
                 message="the cluster working")
        stopping = time.monotonic()
        cluster.process.send_signal(signal.SIGTERM)
        cluster.process.wait(timeout=60)
        stopped_in = time.monotonic() - stopping
    finally:
        cluster.stop()
    # One drain budget (2 s) plus the job in hand (0.5 s) plus django-q2's own shutdown.
    assert stopped_in < 20, stopped_in
    assert Job.objects.filter(pk__in=jobs).exclude(state=JobState.COMPLETED).exists()  # work was left over
    with Cluster(tmp_path / "second.log", ORCHESTRATOR_Q_NAME="stop-drain"):
        wait_for(lambda: Job.objects.filter(pk__in=jobs, state=JobState.COMPLETED).count() == len(jobs),
                 timeout=120, interval=0.3, message="every job completed after the restart")


def idle_workers(*, at_least: int) -> list[str] | None:
    idle = list(WorkerHeartbeat.objects.filter(current_job_id__isnull=True).values_list("worker", flat=True))
    return idle if len(idle) >= at_least else None


@pytest.mark.slow
def test_a_cluster_whose_idle_workers_are_killed_still_executes(project, tmp_path):
    """An idle django-q2 worker waits for the next task; one of them used to wait holding the task
    queue's read lock, so killing it (``kill -9``, the OOM killer) froze the whole cluster while
    every process still looked alive (django-q2 issue #23). Kill every idle worker, twice: the
    reincarnated workers still execute what comes next."""
    import time

    with Cluster(tmp_path / "qcluster.log", ORCHESTRATOR_Q_NAME="idle-kill", ORCHESTRATOR_Q_WORKERS=2):
        for round_number in range(3):
            job = job_enqueue(job_type="probe", project=project, payload={"value": round_number}).job.pk
            wait_for(lambda: Job.objects.get(pk=job).state == JobState.COMPLETED, timeout=30,
                     message=f"job {round_number + 1} completed after {round_number} rounds of kills")
            if round_number == 2:
                break
            beats = wait_for(lambda: idle_workers(at_least=2), timeout=30, message="two idle workers")
            time.sleep(1.0)  # idle: waiting for the next task
            for worker in beats:
                try:
                    os.kill(int(worker.rsplit(":", 1)[1]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            WorkerHeartbeat.objects.filter(worker__in=beats).delete()
