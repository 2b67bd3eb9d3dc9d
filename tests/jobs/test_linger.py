"""A drain that found the queue empty lingers for jobs enqueued meanwhile (PostgreSQL LISTEN/NOTIFY)
and runs them without a wake message."""

import threading
import time
import pytest
from django.db import connection

from jobs import tasks, wake
from jobs.models import Job, JobState
from jobs.services import job_enqueue, jobs_enqueue_many


@pytest.fixture
def lingering(monkeypatch):
    """Set once a drain, its claim empty, starts to linger; no heartbeat thread is started."""
    monkeypatch.setattr("jobs.worker.ensure_started", lambda: None)
    started = threading.Event()
    linger = wake.linger

    def observed(listening, until):
        started.set()
        return linger(listening, until)

    monkeypatch.setattr("jobs.wake.linger", observed)
    return started


def _drain_in_thread(results: list) -> threading.Thread:
    def run():
        try:
            results.append(tasks.drain())
        finally:
            connection.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("bulk", [False, True])
def test_a_lingering_drain_runs_a_job_enqueued_after_it_found_nothing(project, settings, monkeypatch, bulk,
                                                                     lingering):
    settings.ORCHESTRATOR_QUEUE_DRAIN_LINGER_MS = 3_000  # then it comes back: nothing more is enqueued
    sent = []
    monkeypatch.setattr("jobs.wake._send", lambda count: sent.append(count))  # no message reaches a worker
    results: list[int] = []
    thread = _drain_in_thread(results)
    assert lingering.wait(timeout=10)
    if bulk:
        ids = [result.job.pk for result in jobs_enqueue_many(job_type="noop", project=project,
                                                               payloads=[{"n": 0}, {"n": 1}])]
    else:
        ids = [job_enqueue(job_type="noop", project=project, payload={"n": 0}).job.pk]
    thread.join(timeout=20)
    assert not thread.is_alive(), "the drain did not come back: it missed the notification"
    assert results == [len(ids)]
    assert set(Job.objects.filter(pk__in=ids).values_list("state", flat=True)) == {JobState.COMPLETED}


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_job_enqueued_for_later_does_not_wake_a_lingering_drain(project, settings, lingering):
    from datetime import timedelta

    from django.utils import timezone

    settings.ORCHESTRATOR_QUEUE_DRAIN_LINGER_MS = 1_500
    results: list[int] = []
    thread = _drain_in_thread(results)
    assert lingering.wait(timeout=10)
    later = job_enqueue(job_type="noop", project=project, payload={},
                        not_before=timezone.now() + timedelta(hours=1)).job
    thread.join(timeout=20)
    assert results == [0]
    later.refresh_from_db()
    assert later.state == JobState.QUEUED


@pytest.mark.django_db(transaction=True)
def test_without_lingering_a_drain_that_finds_nothing_returns_at_once(project, settings, lingering):
    settings.ORCHESTRATOR_QUEUE_DRAIN_LINGER_MS = 0
    assert wake.listen_mark() is False
    assert tasks.drain() == 0


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_job_tables_statistics_are_taken_again_once_enough_has_changed(project, settings):
    from core.planner import STATISTICS_MIN_CHANGES, statistics_refresh

    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL = 10_000
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    for start in range(0, STATISTICS_MIN_CHANGES + 200, 600):
        jobs_enqueue_many(job_type="noop", project=project, payloads=[{"n": n} for n in range(600)])
    deadline = time.monotonic() + 15  # the server takes the counts in within a second or so
    while "jobs_job" not in statistics_refresh():
        assert time.monotonic() < deadline, "the statistics were never refreshed"
        time.sleep(0.2)
    with connection.cursor() as cursor:
        cursor.execute("SELECT reltuples FROM pg_class WHERE oid = 'jobs_job'::regclass")
        assert cursor.fetchone()[0] >= STATISTICS_MIN_CHANGES  # the planner knows the queue is deep
    assert "jobs_job" not in statistics_refresh()  # nothing changed since


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_job_tables_churn_takes_its_statistics_again_at_most_once_per_interval(project, settings, monkeypatch):
    from core import planner

    monkeypatch.setattr(planner, "STATISTICS_CHURN_INTERVAL_S", 4)
    monkeypatch.setattr(planner, "STATISTICS_GROWTH", 1_000.0)  # the churn rule alone
    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL = 10_000
    jobs_enqueue_many(job_type="noop", project=project, payloads=[{"n": n} for n in range(600)])
    analyzed = time.monotonic()
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")  # 600 rows known (taken of an empty table, any growth counts)
    for size in (600, 600):
        jobs_enqueue_many(job_type="noop", project=project, payloads=[{"n": n} for n in range(size)])
    deadline = time.monotonic() + 15
    with connection.cursor() as cursor:
        while True:  # the server takes the counts in within a second or so
            cursor.execute("SELECT n_mod_since_analyze FROM pg_stat_user_tables WHERE relname = 'jobs_job'")
            if cursor.fetchone()[0] >= 1_200:
                break
            assert time.monotonic() < deadline, "the server never counted the changes"
            time.sleep(0.1)
    assert time.monotonic() - analyzed < 3, "the machine is too slow for this test's timing"
    assert "jobs_job" not in planner.statistics_refresh()  # enough changed, but analyzed under 4 s ago
    while "jobs_job" not in planner.statistics_refresh():
        assert time.monotonic() < deadline, "the statistics were never refreshed"
        time.sleep(0.2)
    assert time.monotonic() - analyzed >= 4
