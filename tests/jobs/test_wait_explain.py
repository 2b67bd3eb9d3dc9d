""""Why is this waiting?": the explanation follows the queue's own claim rules, and the next
claims do what it says."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from jobs.models import JobState, WorkerHeartbeat
from jobs.selectors import job_wait_explain, jobs_wait_explain
from jobs.services import job_claim, job_complete, job_enqueue
from runs import services
from tests.conftest import make_plan

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def worker_alive():
    """A worker seen just now, so "no worker" is not among the reasons unless a test wants it."""
    now = timezone.now()
    return WorkerHeartbeat.objects.create(worker="host:1", started_at=now, last_seen=now)


@pytest.fixture
def types(define_job):
    define_job(type="laned", run=lambda ctx, p: None, lane=lambda p, pid: p.get("lane", ""))
    define_job(type="bg", run=lambda ctx, p: None, priority_class="background",
               lane=lambda p, pid: p.get("lane", ""))
    define_job(type="fg", run=lambda ctx, p: None, priority_class="interactive",
               lane=lambda p, pid: p.get("lane", ""))


def enqueue(project, job_type="laned", *, priority=None, not_before=None, run_id=None, **payload):
    return job_enqueue(job_type=job_type, project=project, payload=payload, priority=priority,
                       not_before=not_before, run_id=run_id).job


def codes(explanation: dict) -> list[str]:
    return [blocker["code"] for blocker in explanation["blockers"]]


def finish(job) -> None:
    assert job_complete(job_id=job.pk, attempt=job.attempts, result=None)


def test_lane_held_by_another_job(project, types):
    holder = enqueue(project, lane="deploy")
    waiting = enqueue(project, lane="deploy")
    holder = job_claim(worker="w1")
    assert holder.lane == f"project:{project.pk}:user:deploy"
    explanation = job_wait_explain(waiting)
    assert codes(explanation) == ["lane_held"]
    assert explanation["lane"] == holder.lane
    assert explanation["lane_holder"]["id"] == holder.pk and explanation["lane_holder"]["worker"] == "w1"
    assert explanation["position"] is None  # not claimable while its lane is held
    assert explanation["caps"] == {"lane_concurrency": 1, "global_concurrency": 2, "executing": 1, "free_slots": 1}
    assert f"job {holder.pk}" in explanation["summary"]
    assert job_claim(worker="w2") is None  # what the explanation says: nothing else may run
    finish(holder)
    assert codes(job_wait_explain(waiting)) == [] and job_wait_explain(waiting)["position"] == 1
    assert job_claim(worker="w2").pk == waiting.pk


def test_position_behind_higher_priority_jobs_predicts_the_claim_order(project, types, settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 1
    jobs = [enqueue(project, "bg", priority=100), enqueue(project, "bg", priority=10),
            enqueue(project, "fg", priority=100), enqueue(project, "bg", priority=50),
            enqueue(project, "bg", priority=100)]
    explanations = jobs_wait_explain(jobs)
    positions = {job.pk: explanations[job.pk]["position"] for job in jobs}
    assert sorted(positions.values()) == [1, 2, 3, 4, 5]
    last = explanations[jobs[4].pk]
    assert last["jobs_ahead"] == 4 and last["eligible_jobs"] == 5 and codes(last) == ["behind"]
    assert (last["priority"], last["priority_class"]) == (100, "background") and last["age_s"] >= 0
    assert "4 claimable jobs ahead" in last["summary"]
    claimed = []
    for _ in jobs:
        job = job_claim(worker="w1")
        claimed.append(job.pk)
        finish(job)
    assert claimed == sorted(positions, key=positions.get)
    # lower priority first, interactive before background at equal priority, then FIFO
    assert claimed == [jobs[1].pk, jobs[3].pk, jobs[2].pk, jobs[0].pk, jobs[4].pk]


def test_delayed_by_not_before(project, types, worker_alive):
    later = timezone.now() + timedelta(seconds=30)
    delayed = enqueue(project, not_before=later, lane="reports")
    explanation = job_wait_explain(delayed)
    assert codes(explanation) == ["delayed"]
    assert explanation["eligible_at"] == later.isoformat() == explanation["not_before"]
    assert 0 < explanation["eligible_in_s"] <= 30
    assert explanation["position"] is None
    assert job_claim(worker="w1") is None
    WorkerHeartbeat.objects.filter(pk=worker_alive.pk).update(last_seen=later)  # still alive then
    after = job_wait_explain(delayed, now=later + timedelta(seconds=1))
    assert codes(after) == [] and after["position"] == 1
    assert job_claim(worker="w1", now=later + timedelta(seconds=1)).pk == delayed.pk


def test_global_cap_reached(project, types, settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 1
    enqueue(project, lane="a")
    waiting = enqueue(project, lane="b")
    running = job_claim(worker="w1")
    assert running.lane == f"project:{project.pk}:user:a"
    explanation = job_wait_explain(waiting)
    assert codes(explanation) == ["global_cap"]
    assert explanation["caps"] == {"lane_concurrency": 1, "global_concurrency": 1, "executing": 1, "free_slots": 0}
    assert explanation["position"] == 1  # first in line once a slot frees
    assert "1 concurrency slots are busy" in explanation["summary"]
    assert job_claim(worker="w2") is None
    finish(running)
    assert job_claim(worker="w2").pk == waiting.pk


def test_aged_background_job_goes_before_the_lane_interactive_jobs(project, types, settings):
    settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS = 0
    settings.ORCHESTRATOR_QUEUE_MAX_INTERACTIVE_BURST = 1
    first = enqueue(project, "fg", lane="chat")
    finish(job_claim(worker="w1"))  # the lane ran its burst of one interactive job
    assert first.pk
    background = enqueue(project, "bg", lane="chat")
    interactive = enqueue(project, "fg", lane="chat")
    explanations = jobs_wait_explain([background, interactive])
    assert explanations[background.pk]["aging"]["jumps_queue"] is True
    assert explanations[background.pk]["position"] == 1
    assert explanations[interactive.pk]["position"] == 2 and explanations[interactive.pk]["aging"] is None
    assert job_claim(worker="w1").pk == background.pk


def test_background_job_not_aged_yet_says_when_it_ages(project, types, settings):
    settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS = 60_000
    job = enqueue(project, "bg", lane="chat")
    aging = job_wait_explain(job)["aging"]
    assert aging["aged"] is False and 0 < aging["ages_in_s"] <= 60


def test_no_worker_alive_is_a_reason(project, types, worker_alive):
    job = enqueue(project, lane="x")
    assert codes(job_wait_explain(job)) == []
    WorkerHeartbeat.objects.filter(pk=worker_alive.pk).update(last_seen=timezone.now() - timedelta(hours=1))
    explanation = job_wait_explain(job)
    assert codes(explanation) == ["no_worker"] and explanation["workers_alive"] == 0


def test_a_job_that_is_not_waiting_says_so(project, types):
    job = enqueue(project, lane="x")
    claimed = job_claim(worker="w1")
    explanation = job_wait_explain(claimed)
    assert explanation["waiting"] is False and codes(explanation) == []
    assert explanation["summary"].startswith("Not waiting: executing on w1")
    finish(claimed)
    job.refresh_from_db()
    assert job_wait_explain(job)["summary"] == "Not waiting: completed (completed)."


def test_queries_are_bounded(project, types):
    few = [enqueue(project, lane=f"l{n}") for n in range(3)]
    with CaptureQueriesContext(connection) as small:
        jobs_wait_explain(few[:1])
    many = few + [enqueue(project, lane=f"m{n}") for n in range(40)]
    with CaptureQueriesContext(connection) as large:
        job_wait_explain(many[-1])
    assert len(small.captured_queries) == len(large.captured_queries) <= 5  # the fifth: the queue's pause


def test_job_and_run_pages_show_the_explanation(project, types, django_user_model, client):
    client.force_login(django_user_model.objects.create_user(username="root", is_staff=True, is_superuser=True))
    run = services.run_create(project=project, name="waits", plan=make_plan())
    holder = enqueue(project, lane="deploy")
    waiting = enqueue(project, lane="deploy", run_id=run.pk)
    job_claim(worker="w1")

    job_page = client.get(reverse("admin:jobs_job_change", args=[waiting.pk])).content.decode()
    assert "Why is this waiting?" in job_page
    assert f'data-job="{waiting.pk}" data-wait-blockers="lane_held"' in job_page
    assert reverse("admin:jobs_job_change", args=[holder.pk]) in job_page
    holder_page = client.get(reverse("admin:jobs_job_change", args=[holder.pk])).content.decode()
    assert "Why is this waiting?" not in holder_page  # executing: nothing to explain

    run_page = client.get(reverse("admin:runs_run_change", args=[run.pk]))
    assert run_page.status_code == 200
    html = run_page.content.decode()
    assert "why is this waiting?" in html.lower()
    assert f'data-job="{waiting.pk}" data-wait-blockers="lane_held"' in html
    assert waiting.state == JobState.QUEUED
