"""``/metrics``: access, every required family, values computed from the database."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta

import pytest
from django.db import transaction
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from billing.services import organization_create
from billing.metrics import ledger_rollup
from core.metrics import metrics_compact
from core.models import MetricDelta
from jobs.models import Job, JobState, WorkerHeartbeat
from jobs.registry import Dedupe, RetryPolicy
from jobs.services import job_cancel, job_enqueue
from runs import services as run_services
from tests.conftest import make_plan
from tests.drive import drain_jobs
from tests.processes import BASE_DIR, database_env

pytestmark = pytest.mark.django_db
TOKEN = "s3cret-metrics-token"


@pytest.fixture(autouse=True)
def metrics_token(settings):
    settings.ORCHESTRATOR_METRICS_TOKEN = TOKEN


def scrape(client: Client | None = None) -> dict[str, dict[tuple, float]]:
    """``{sample name: {sorted label items: value}}`` of one scrape with the token."""
    response = (client or Client()).get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


# --- access ---------------------------------------------------------------------------------

def test_without_credentials_the_answer_is_401_json(client):
    response = client.get("/metrics")
    assert response.status_code == 401
    assert response.json()["code"] == "not_authenticated"
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_a_wrong_token_is_401_and_the_right_one_200(client):
    response = client.get("/metrics", HTTP_AUTHORIZATION="Bearer nope")
    assert response.status_code == 401
    assert response.json()["code"] == "authentication_failed"
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200


def test_no_token_is_accepted_when_none_is_configured(client, settings):
    settings.ORCHESTRATOR_METRICS_TOKEN = ""
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer anything").status_code == 401


def test_a_staff_session_may_read_and_a_member_session_may_not(client, staff, django_user_model):
    member = django_user_model.objects.create_user(username="member", password="pw")
    client.force_login(member)
    response = client.get("/metrics")
    assert response.status_code == 403
    assert response.json()["code"] == "permission_denied"
    client.force_login(staff)
    response = client.get("/metrics")
    assert response.status_code == 200
    assert b"orchestrator_queue_depth" in response.content


def test_only_get_is_allowed(client):
    response = client.post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 405
    assert response.json()["code"] == "method_not_allowed"


# --- values ---------------------------------------------------------------------------------

def test_queue_counters_by_type_and_reason(project, define_job):
    define_job(type="obs_flaky", run=lambda ctx, payload: (_ for _ in ()).throw(ConnectionError("down")),
               retry=RetryPolicy(max_attempts=2, base_delay_ms=1, jitter=False), lane=lambda p, pid: "")
    define_job(type="obs_single", run=lambda ctx, payload: {"ok": True},
               dedupe=Dedupe("single_flight", key=lambda payload, project_id: "same"), lane=lambda p, pid: "")
    for _ in range(3):
        job_enqueue(job_type="noop", project=project, payload={})
    job_enqueue(job_type="obs_flaky", project=project, payload={})
    first = job_enqueue(job_type="obs_single", project=project, payload={})
    second = job_enqueue(job_type="obs_single", project=project, payload={})
    assert second.dedupe == "already_queued" and second.job.pk == first.job.pk
    cancelled = job_enqueue(job_type="noop", project=project, payload={"value": "cancel me"})
    job_cancel(job_id=cancelled.job.pk, reason="not needed")

    before = scrape()
    assert value(before, "orchestrator_queue_depth") == 5  # 3 noop, flaky, single (the cancelled one is gone)
    assert value(before, "orchestrator_project_queue_depth", project=str(project.pk)) == 5
    assert value(before, "orchestrator_queue_depth_by_type", type="noop") == 3

    drain_jobs()
    samples = scrape()
    assert value(samples, "orchestrator_jobs_enqueued_total", type="noop") == 4
    assert value(samples, "orchestrator_jobs_enqueued_total", type="obs_single") == 1
    assert value(samples, "orchestrator_job_dedupe_hits_total", type="obs_single", outcome="already_queued") == 1
    assert value(samples, "orchestrator_job_attempts_total", type="noop") == 3
    assert value(samples, "orchestrator_job_attempts_total", type="obs_flaky") == 2
    assert value(samples, "orchestrator_job_retries_total", type="obs_flaky") == 1
    assert value(samples, "orchestrator_job_retries_total", type="noop") == 0
    assert value(samples, "orchestrator_job_failures_total", type="obs_flaky", reason="max_attempts_exhausted") == 1
    assert value(samples, "orchestrator_job_completions_total", type="noop", reason="completed") == 3
    assert value(samples, "orchestrator_job_cancels_total", type="noop", reason="cancelled") == 1
    assert value(samples, "orchestrator_job_run_seconds_count", type="noop", state="completed") == 3
    assert value(samples, "orchestrator_job_run_seconds_bucket", type="noop", state="completed", le="+Inf") == 3
    assert value(samples, "orchestrator_job_wait_seconds_count", type="noop", priority="background") == 3
    assert value(samples, "orchestrator_queue_depth") == 0
    assert value(samples, "orchestrator_project_queue_depth", project=str(project.pk)) == 0


def test_a_rolled_back_change_counts_nothing(project):
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            job_enqueue(job_type="noop", project=project, payload={})
            raise RuntimeError("roll back")
    assert value(scrape(), "orchestrator_jobs_enqueued_total", type="noop") == 0


def test_counters_read_the_same_before_and_after_folding_and_after_jobs_are_pruned(project):
    for _ in range(4):
        job_enqueue(job_type="noop", project=project, payload={})
    drain_jobs()
    assert MetricDelta.objects.exists()
    pending = scrape()  # the scrape folds what is pending
    assert not MetricDelta.objects.exists()
    job_enqueue(job_type="noop", project=project, payload={})  # one more pending sample
    after = scrape()
    assert value(pending, "orchestrator_jobs_enqueued_total", type="noop") == 4
    assert value(after, "orchestrator_jobs_enqueued_total", type="noop") == 5
    # Counters never go down when job history is deleted.
    Job.objects.all().delete()
    assert value(scrape(), "orchestrator_jobs_enqueued_total", type="noop") == 5
    assert value(scrape(), "orchestrator_job_completions_total", type="noop", reason="completed") == 4


@pytest.mark.django_db(transaction=True)
def test_runs_credits_and_ledger_entries(org_factory):
    organization, project, owner = org_factory(credits=500)
    run = run_services.run_create(project=project, name="m", plan=make_plan(steps=2), actor=owner)
    run_services.run_start(run_id=run.pk, actor=owner)
    samples = scrape()
    assert value(samples, "orchestrator_runs", state="pending") == 1
    assert value(samples, "orchestrator_runs", state="completed") == 0
    reserved = run.__class__.objects.get(pk=run.pk).credits_reserved
    assert reserved > 0
    assert value(samples, "orchestrator_credits_reserved") == reserved
    assert value(samples, "orchestrator_organization_credits_reserved", organization=str(organization.pk)) == reserved
    assert value(samples, "orchestrator_ledger_entries_total", kind="topup") == 1
    assert value(samples, "orchestrator_ledger_entries_total", kind="reserve") == 1
    assert value(samples, "orchestrator_ledger_credits_total", kind="topup") == 500

    drain_jobs(until=lambda: run.__class__.objects.get(pk=run.pk).status == "completed"
               and not Job.objects.filter(run_id=run.pk, state__in=["queued", "executing", "awaiting_tool"]).exists())
    samples = scrape()
    assert value(samples, "orchestrator_runs", state="completed") == 1
    assert value(samples, "orchestrator_runs", state="pending") == 0
    assert value(samples, "orchestrator_credits_reserved") == 0
    charges = value(samples, "orchestrator_ledger_entries_total", kind="charge")
    assert charges == 2
    # Rolling the ledger up into totals changes no figure.
    assert ledger_rollup(now=timezone.now() + timedelta(hours=1)) > 0
    rolled = scrape()
    for kind in ("topup", "reserve", "charge", "refund"):
        assert value(rolled, "orchestrator_ledger_entries_total", kind=kind) == \
            value(samples, "orchestrator_ledger_entries_total", kind=kind), kind
        assert value(rolled, "orchestrator_ledger_credits_total", kind=kind) == \
            value(samples, "orchestrator_ledger_credits_total", kind=kind), kind
    organization_create(name="later", owner_username="later-owner", credits=7)
    assert value(scrape(), "orchestrator_ledger_entries_total", kind="topup") == 2


def test_aged_background_wait_and_worker_liveness(project, settings):
    settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS = 1000
    old = job_enqueue(job_type="noop", project=project, payload={}).job
    job_enqueue(job_type="noop", project=project, payload={})
    Job.objects.filter(pk=old.pk).update(queued_at=timezone.now() - timedelta(seconds=90))
    now = timezone.now()
    WorkerHeartbeat.objects.create(worker="host:1", cluster="c", started_at=now, last_seen=now)
    WorkerHeartbeat.objects.create(worker="host:2", cluster="c", started_at=now - timedelta(hours=1),
                                   last_seen=now - timedelta(minutes=10))
    samples = scrape()
    assert value(samples, "orchestrator_background_aged_jobs") == 1
    assert 90 <= value(samples, "orchestrator_background_oldest_wait_seconds") < 3600
    assert value(samples, "orchestrator_workers_alive") == 1
    assert value(samples, "orchestrator_workers_stale") == 1
    assert value(samples, "orchestrator_worker_heartbeat_age_seconds", worker="host:2", cluster="c") >= 600


def test_relay_lag_is_the_answering_process_relay(monkeypatch, project):
    assert value(scrape(), "orchestrator_relay_running") == 0
    first = job_enqueue(job_type="noop", project=project, payload={}).job
    from core.models import Event

    cursor = Event.objects.filter(payload__jobId=first.pk).values_list("id", flat=True).first() - 1
    monkeypatch.setattr("core.relay.relay_status", lambda: {"cursor": cursor, "latest": cursor + 1, "lag": 1,
                                                            "subscriptions": 0})
    samples = scrape()
    assert value(samples, "orchestrator_relay_running") == 1
    assert value(samples, "orchestrator_relay_lag_events") == 1
    assert value(samples, "orchestrator_relay_oldest_unrelayed_seconds") >= 0


@pytest.mark.django_db(transaction=True)
def test_work_done_in_another_process_is_counted(project):
    """Samples come from the database, so another process's jobs show in this one's scrape."""
    script = ("from core.models import Project; from jobs.services import job_enqueue; "
              f"p = Project.objects.get(pk={project.pk}); "
              "[job_enqueue(job_type='probe', project=p, payload={}) for _ in range(3)]")
    env = {**database_env(), "ORCHESTRATOR_TRANSITION_LOG_LEVEL": "WARNING"}
    subprocess.run([sys.executable, "manage.py", "shell", "-c", script], cwd=BASE_DIR, env=env, check=True,
                   capture_output=True, timeout=120)
    samples = scrape()
    assert value(samples, "orchestrator_jobs_enqueued_total", type="probe") == 3
    assert value(samples, "orchestrator_queue_depth_by_type", type="probe") == 3
    assert Job.objects.filter(type="probe", state=JobState.QUEUED).count() == 3


def test_folding_in_small_batches_loses_nothing(project):
    for _ in range(7):
        job_enqueue(job_type="noop", project=project, payload={})
    pending = MetricDelta.objects.count()
    assert metrics_compact(batch=2) >= pending
    assert not MetricDelta.objects.exists()
    assert value(scrape(), "orchestrator_jobs_enqueued_total", type="noop") == 7


@pytest.mark.django_db(transaction=True)
def test_two_worker_processes_and_concurrent_scrapes_count_every_job_once(project):
    """Two processes execute jobs while this one scrapes (and folds) again and again: every
    scrape is monotonic and the last one counts each job exactly once."""
    total = 40
    for _ in range(total):
        job_enqueue(job_type="noop", project=project, payload={})
    script = ("from jobs.services import job_claim; from jobs.executor import job_run_claimed; import os\n"
              "me = f'proc-{os.getpid()}'\n"
              "while (job := job_claim(worker=me)) is not None:\n"
              "    job_run_claimed(job, worker=me)\n")
    env = {**database_env(), "ORCHESTRATOR_TRANSITION_LOG_LEVEL": "WARNING", "ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY": "4"}
    workers = [subprocess.Popen([sys.executable, "manage.py", "shell", "-c", script], cwd=BASE_DIR, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
    seen = []
    while any(worker.poll() is None for worker in workers):
        seen.append(value(scrape(), "orchestrator_job_completions_total", type="noop", reason="completed"))
    for worker in workers:
        assert worker.wait(120) == 0, worker.stderr.read().decode()[-2000:]
    final = scrape()
    assert seen == sorted(seen)
    assert value(final, "orchestrator_job_completions_total", type="noop", reason="completed") == total
    assert value(final, "orchestrator_job_attempts_total", type="noop") == total
    assert value(final, "orchestrator_job_run_seconds_count", type="noop", state="completed") == total
    assert Job.objects.filter(state=JobState.COMPLETED).count() == total
