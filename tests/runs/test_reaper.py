"""The run reaper: DESIGN §2.1 timeouts and orphaned runs, through the services."""

from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.models import Job
from runs import services
from runs.invariants import invariants_check
from runs.models import Run
from runs.reaper import runs_reap
from tests.conftest import make_plan

LATER = timedelta(days=8)


@pytest.fixture(autouse=True)
def no_wake_messages(monkeypatch):
    monkeypatch.setattr("jobs.wake._send", lambda count: None)


def started(project, **options):
    run = services.run_create(project=project, name="reaped", plan=make_plan(), **options)
    return services.run_start(run_id=run.pk)


def ticks_gone(run):
    """The run's job queued with its start gone, as once a worker that ran it
    finished and their rows were retired: nothing of the run waits in the queue any more."""
    Job.objects.filter(run_id=run.pk).delete()


def test_a_pending_run_past_its_timeout_fails_and_refunds(project):
    run = started(project)
    assert runs_reap()["timed_out"] == 0
    runs_reap(now=timezone.now() + LATER)
    run.refresh_from_db()
    assert (run.status, run.last_error_code) == (Run.Status.FAILED, "pending_timeout")
    assert run.credits_refunded == run.credits_reserved
    assert invariants_check() == []


def test_paused_too_long_is_cancelled_and_resuming_too_long_fails(project):
    paused = started(project)
    services.run_mark_running(run_id=paused.pk)
    services.run_pause(run_id=paused.pk)
    resuming = started(project)
    services.run_mark_running(run_id=resuming.pk)
    services.run_pause(run_id=resuming.pk)
    services.run_resume(run_id=resuming.pk)
    runs_reap(now=timezone.now() + LATER)
    paused.refresh_from_db()
    resuming.refresh_from_db()
    assert (paused.status, paused.last_error_code) == (Run.Status.CANCELLED, "paused_timeout")
    assert (resuming.status, resuming.last_error_code) == (Run.Status.FAILED, "resuming_timeout")
    assert invariants_check() == []


def test_a_silent_running_run_fails_with_heartbeat_timeout_unless_its_work_waits_in_the_queue(project, settings):
    waiting = started(project)
    services.run_mark_running(run_id=waiting.pk)
    from jobs.services import job_enqueue

    job_enqueue(job_type="noop", project=project, payload={}, run_id=waiting.pk)
    silent = started(project)
    services.run_mark_running(run_id=silent.pk)
    ticks_gone(silent)
    soon = timezone.now() + timedelta(seconds=settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S + 5)
    done = runs_reap(now=soon)
    waiting.refresh_from_db()
    silent.refresh_from_db()
    assert done["heartbeat"] >= 1
    assert waiting.status == Run.Status.RUNNING  # its next job is queued: not a dead worker
    assert (silent.status, silent.last_error_code) == (Run.Status.FAILED, "heartbeat_timeout")


def test_an_active_run_without_any_job_is_dispatched_again(project, django_capture_on_commit_callbacks):
    run = started(project)
    assert Job.objects.filter(run_id=run.pk).count() == 1  # queued with the start
    assert runs_reap(now=timezone.now() + timedelta(seconds=30))["redispatched"] == 0
    ticks_gone(run)  # lost: a worker that took it died, and its row is gone
    assert runs_reap(now=timezone.now() + timedelta(seconds=30))["redispatched"] == 1
    assert Job.objects.filter(run_id=run.pk, type="run_tick").count() == 1
    assert runs_reap(now=timezone.now() + timedelta(seconds=30))["redispatched"] == 0  # it has one now
