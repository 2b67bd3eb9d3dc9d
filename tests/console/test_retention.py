"""Retention: ``prune`` and its schedule delete what may go, in batches, and nothing else."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.files.base import ContentFile
from django.core.management import CommandError, call_command
from django.utils import timezone

from billing.models import LedgerEntry
from core.models import AuditRecord, Event, IdempotencyRecord, MetricDelta, RateLimitCounter
from core.ratelimit import DatabaseStore, Rate, rate_limit_hit
from console.retention import MIN_AGE, retention_prune, retention_prune_scheduled
from jobs.models import Job, JobState, WorkerHeartbeat
from jobs.services import job_cancel, job_enqueue
from runs import services as run_services
from runs.models import Artifact, Run
from tests.api.conftest import assert_error
from tests.conftest import make_plan
from tests.drive import drain_jobs

pytestmark = pytest.mark.django_db
DAY = timedelta(days=1)


@pytest.fixture
def artifact_storage(settings, tmp_path):
    settings.STORAGES = {**settings.STORAGES, "artifacts": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}}}
    from django.core.files.storage import storages

    return storages["artifacts"]


def age(queryset, field: str, days: float) -> None:
    queryset.update(**{field: timezone.now() - timedelta(days=days)})


def finished_jobs(project, count: int) -> list[int]:
    ids = [job_enqueue(job_type="noop", project=project, payload={}).job.pk for _ in range(count)]
    drain_jobs()
    return ids


def prune(*args) -> str:
    out = StringIO()
    call_command("prune", *args, stdout=out)
    return out.getvalue()


def test_terminal_jobs_and_events_past_retention_go_ledger_and_audit_stay(project, org_factory, settings):
    settings.ORCHESTRATOR_RETENTION_DAYS = 7
    old = finished_jobs(project, 3)
    recent = finished_jobs(project, 2)
    waiting = job_enqueue(job_type="noop", project=project, payload={}).job
    age(Job.objects.filter(pk__in=[*old, waiting.pk]), "completed_at", 8)
    age(Job.objects.filter(pk=waiting.pk), "created_at", 30)
    old_events = list(Event.objects.filter(payload__jobId__in=old).values_list("id", flat=True))
    age(Event.objects.filter(id__in=old_events), "created_at", 8)
    age(AuditRecord.objects.all(), "created_at", 400)
    ledger_before = LedgerEntry.objects.count()
    audit_before = AuditRecord.objects.count()

    out = prune()
    assert "jobs" in out and "events" in out
    assert set(Job.objects.values_list("pk", flat=True)) == {*recent, waiting.pk}  # a waiting job is never pruned
    assert not Event.objects.filter(id__in=old_events).exists()
    assert Event.objects.filter(payload__jobId__in=recent).count() == 6
    assert LedgerEntry.objects.count() == ledger_before and AuditRecord.objects.count() == audit_before


def test_dry_run_counts_and_changes_nothing(project):
    old = finished_jobs(project, 2)
    age(Job.objects.filter(pk__in=old), "completed_at", 30)
    out = prune("--dry-run")
    assert "dry run" in out and "would delete" in out
    assert Job.objects.filter(pk__in=old).count() == 2
    summary = json.loads(prune("--dry-run", "--json"))
    assert summary["dry_run"] is True
    jobs = next(step for step in summary["steps"] if step["step"] == "jobs")
    assert (jobs["matched"], jobs["done"]) == (2, 0)
    assert Job.objects.filter(pk__in=old).count() == 2


def test_a_projects_own_retention_wins(org_factory, settings):
    settings.ORCHESTRATOR_RETENTION_DAYS = 30
    _, short_lived, _ = org_factory()
    _, default, _ = org_factory()
    short_lived.retention_days = 2
    short_lived.save(update_fields=["retention_days"])
    short_jobs = finished_jobs(short_lived, 2)
    default_jobs = finished_jobs(default, 2)
    age(Job.objects.all(), "completed_at", 3)
    results = {result.name: result for result in retention_prune(only=["jobs"])}
    assert results["jobs"].done == 2
    assert not Job.objects.filter(pk__in=short_jobs).exists()
    assert Job.objects.filter(pk__in=default_jobs).count() == 2


def test_nothing_younger_than_the_minimum_age_goes_even_with_zero_retention(project):
    project.retention_days = 0
    project.save(update_fields=["retention_days"])
    jobs = finished_jobs(project, 2)
    retention_prune(only=["jobs", "events"])
    assert Job.objects.filter(pk__in=jobs).count() == 2
    age(Job.objects.filter(pk__in=jobs), "completed_at", (MIN_AGE + timedelta(minutes=1)) / DAY)
    retention_prune(only=["jobs"])
    assert not Job.objects.filter(pk__in=jobs).exists()


@pytest.mark.django_db(transaction=True)
def test_history_of_a_live_run_is_kept_whatever_its_age(project, monkeypatch):
    monkeypatch.setattr("jobs.wake._send", lambda count: None)
    run = run_services.run_create(project=project, name="long", plan=make_plan())
    run_services.run_start(run_id=run.pk)
    age(Event.objects.filter(run_id=run.pk), "created_at", 400)
    assert retention_prune(only=["events"])[0].done == 0
    assert Event.objects.filter(run_id=run.pk).count() >= 2
    run_services.run_cancel(run_id=run.pk, reason="done")
    age(Event.objects.filter(run_id=run.pk), "created_at", 400)
    retention_prune(only=["events"])
    assert not Event.objects.filter(run_id=run.pk).exists()
    assert Run.objects.filter(pk=run.pk).exists()  # runs (and their ledger) are never pruned


def test_events_a_relay_here_has_not_delivered_are_kept(project, monkeypatch):
    job = job_enqueue(job_type="noop", project=project, payload={}).job
    job_cancel(job_id=job.pk)
    ids = sorted(Event.objects.filter(payload__jobId=job.pk).values_list("id", flat=True))
    age(Event.objects.all(), "created_at", 400)
    monkeypatch.setattr("console.retention.relay_status", lambda: {"cursor": ids[0], "latest": ids[-1], "lag": 1,
                                                            "subscriptions": 0})
    retention_prune(only=["events"])
    assert list(Event.objects.filter(id__in=ids).values_list("id", flat=True)) == ids[1:]


def test_deletes_run_in_batches(project):
    jobs = finished_jobs(project, 7)
    age(Job.objects.filter(pk__in=jobs), "completed_at", 400)
    out = prune("--only", "jobs", "--batch", "3")
    assert not Job.objects.filter(pk__in=jobs).exists()
    assert "7" in out


def test_expired_idempotency_keys_rate_windows_workers_and_metric_samples(tenant, settings):
    settings.ORCHESTRATOR_API_RATE = ""  # the only rate windows are the two written below
    tenant.client.post("/api/v1/runs/", tenant.run_body(), format="json", HTTP_IDEMPOTENCY_KEY="old")
    tenant.client.post("/api/v1/runs/", tenant.run_body(name="b"), format="json", HTTP_IDEMPOTENCY_KEY="new")
    IdempotencyRecord.objects.filter(key="old").update(expires_at=timezone.now() - timedelta(minutes=1))
    now = timezone.now()
    rate_limit_hit("user:1", Rate(10, 60), now=(now - timedelta(hours=2)).timestamp(), store=DatabaseStore())
    rate_limit_hit("user:1", Rate(10, 60), now=now.timestamp(), store=DatabaseStore())
    WorkerHeartbeat.objects.create(worker="gone:1", started_at=now - 40 * DAY, last_seen=now - 30 * DAY)
    WorkerHeartbeat.objects.create(worker="here:1", started_at=now, last_seen=now)
    job_enqueue(job_type="noop", project=tenant.project, payload={})
    assert MetricDelta.objects.exists()
    prune()
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["new"]
    assert RateLimitCounter.objects.count() == 1
    assert list(WorkerHeartbeat.objects.values_list("worker", flat=True)) == ["here:1"]
    assert not MetricDelta.objects.exists()  # folded into totals, not lost


def test_prune_idempotency_is_the_idempotency_step(tenant):
    tenant.client.post("/api/v1/runs/", tenant.run_body(), format="json", HTTP_IDEMPOTENCY_KEY="old")
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(minutes=1))
    out = StringIO()
    call_command("prune_idempotency", stdout=out)
    assert "deleted 1 expired" in out.getvalue()
    assert not IdempotencyRecord.objects.exists()


def test_bad_arguments_are_command_errors():
    with pytest.raises(CommandError):
        call_command("prune", "--batch", "0", stdout=StringIO())
    with pytest.raises(CommandError):
        call_command("prune", "--only", "ledger", stdout=StringIO())


def test_the_schedule_runs_the_prune():
    from django_q.models import Schedule

    schedule = Schedule.objects.get(name="orchestrator-retention")
    assert schedule.func == "console.retention.retention_prune_scheduled"
    assert (schedule.schedule_type, schedule.minutes, schedule.repeats) == ("I", 10, -1)
    assert set(retention_prune_scheduled()) >= {"idempotency", "artifacts", "jobs", "events"}


# --- artifacts ----------------------------------------------------------------------------------

def make_artifact(storage, run, name: str, *, expires_in: timedelta | None) -> Artifact:
    key = storage.save(f"runs/{run.pk}/{name}", ContentFile(b"artifact bytes"))
    return Artifact.objects.create(run=run, name=name, storage_key=key, size_bytes=14,
                                   expires_at=None if expires_in is None else timezone.now() + expires_in)


@pytest.fixture
def tenant_run(tenant):
    response = tenant.client.post("/api/v1/runs/", tenant.run_body(), format="json")
    return Run.objects.get(pk=response.json()["id"])


def test_expired_artifacts_are_deleted_from_storage_and_marked(artifact_storage, tenant_run):
    expired = make_artifact(artifact_storage, tenant_run, "old.txt", expires_in=-timedelta(minutes=1))
    current = make_artifact(artifact_storage, tenant_run, "new.txt", expires_in=timedelta(days=3))
    pending = make_artifact(artifact_storage, tenant_run, "open.txt", expires_in=None)
    results = {result.name: result for result in retention_prune(only=["artifacts"])}
    assert results["artifacts"].done == 1
    expired.refresh_from_db()
    assert expired.deleted_at is not None and not artifact_storage.exists(expired.storage_key)
    for kept in (current, pending):
        kept.refresh_from_db()
        assert kept.deleted_at is None and artifact_storage.exists(kept.storage_key)
    assert retention_prune(only=["artifacts"])[0].done == 0  # marked: not matched again


def test_reading_an_artifact_extends_its_expiry_so_the_prune_keeps_it(artifact_storage, tenant, tenant_run,
                                                                      settings):
    settings.ORCHESTRATOR_ARTIFACT_ACCESS_EXTENSION_S = 3600
    artifact = make_artifact(artifact_storage, tenant_run, "report.txt", expires_in=timedelta(seconds=5))
    response = tenant.client.get(f"/api/v1/artifacts/{artifact.pk}/download/")
    assert response.status_code == 200
    assert b"".join(response.streaming_content) == b"artifact bytes"
    artifact.refresh_from_db()
    assert artifact.expires_at >= timezone.now() + timedelta(minutes=59)
    retention_prune(only=["artifacts"], now=timezone.now() + timedelta(minutes=30))
    artifact.refresh_from_db()
    assert artifact.deleted_at is None and artifact_storage.exists(artifact.storage_key)
    retention_prune(only=["artifacts"], now=timezone.now() + timedelta(hours=2))
    artifact.refresh_from_db()
    assert artifact.deleted_at is not None
    body = assert_error(tenant.client.get(f"/api/v1/artifacts/{artifact.pk}/download/"), 410, "artifact_expired")
    assert body["deleted_at"]
    detail = tenant.client.get(f"/api/v1/artifacts/{artifact.pk}/").json()
    assert detail["deleted_at"] is not None and detail["run"] == tenant_run.pk


def test_a_later_expiry_is_never_shortened_by_a_read(artifact_storage, tenant, tenant_run):
    artifact = make_artifact(artifact_storage, tenant_run, "keep.txt", expires_in=timedelta(days=20))
    before = artifact.expires_at
    assert tenant.client.get(f"/api/v1/artifacts/{artifact.pk}/download/").status_code == 200
    artifact.refresh_from_db()
    assert artifact.expires_at == before


def test_artifacts_of_another_organization_are_404(artifact_storage, tenant, other, tenant_run):
    artifact = make_artifact(artifact_storage, tenant_run, "secret.txt", expires_in=timedelta(days=1))
    assert_error(other.client.get(f"/api/v1/artifacts/{artifact.pk}/"), 404, "not_found")
    assert_error(other.client.get(f"/api/v1/artifacts/{artifact.pk}/download/"), 404, "not_found")
    assert_error(other.client.get(f"/api/v1/artifacts/?run={tenant_run.pk}"), 404, "not_found")
    listed = tenant.client.get(f"/api/v1/artifacts/?run={tenant_run.pk}").json()
    assert [row["name"] for row in listed["results"]] == ["secret.txt"]


def test_a_file_missing_from_storage_is_404_not_500(artifact_storage, tenant, tenant_run):
    artifact = make_artifact(artifact_storage, tenant_run, "lost.txt", expires_in=timedelta(days=1))
    artifact_storage.delete(artifact.storage_key)
    assert_error(tenant.client.get(f"/api/v1/artifacts/{artifact.pk}/download/"), 404, "not_found")


def test_a_table_stays_bounded_under_steady_load(project, settings):
    """Each round adds jobs and ages the earlier ones past retention; the table never grows past
    what one retention window holds."""
    settings.ORCHESTRATOR_RETENTION_DAYS = 1
    sizes = []
    for _ in range(4):
        age(Job.objects.filter(state=JobState.COMPLETED), "completed_at", 2)
        age(Event.objects.filter(project_id=project.pk), "created_at", 2)
        finished_jobs(project, 5)
        retention_prune(only=["jobs", "events"])
        sizes.append((Job.objects.count(), Event.objects.filter(project_id=project.pk).count()))
    assert sizes == [(5, 15)] * 4


def test_set_retention_changes_a_project_with_an_audit_record(project, settings):
    settings.ORCHESTRATOR_RETENTION_DAYS = 14
    out = StringIO()
    call_command("set_retention", str(project.pk), "--days", "3", "--reason", "noisy project", stdout=out)
    project.refresh_from_db()
    assert project.retention_days == 3
    assert "kept 3 days" in out.getvalue()
    audit = AuditRecord.objects.get(action="project_retention_set")
    assert (audit.before, audit.after, audit.reason) == ({"retention_days": None}, {"retention_days": 3},
                                                         "noisy project")
    out = StringIO()
    call_command("set_retention", str(project.pk), "--default", "--reason", "back to normal", stdout=out)
    project.refresh_from_db()
    assert project.retention_days is None and "14 (the default)" in out.getvalue()


@pytest.mark.parametrize("args, message", [(["999999", "--days", "3"], "does not exist"),
                                           (["{project}", "--days", "-1"], "from 0 to 36500"),
                                           (["{project}"], "one of the arguments --days --default is required")])
def test_set_retention_refuses_bad_input(project, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("set_retention", *[arg.format(project=project.pk) for arg in args], "--reason", "x",
                     stdout=StringIO(), stderr=StringIO())
    project.refresh_from_db()
    assert project.retention_days is None


@pytest.mark.parametrize("end", ["complete", "fail", "cancel"])
def test_artifacts_start_to_expire_when_their_run_ends_however_it_ends(artifact_storage, project, settings, end):
    from runs import services
    from tests.conftest import make_plan

    settings.ORCHESTRATOR_ARTIFACT_TTL_DAYS = 7
    run = services.run_create(project=project, name="ends", plan=make_plan())
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    artifact = make_artifact(artifact_storage, run, "report.txt", expires_in=None)
    if end == "complete":
        from runs.models import Step

        step = Step.objects.get(run=run)
        services.step_attempt_succeed(attempt_id=services.step_begin(step_id=step.pk).pk, output={"ok": True})
    elif end == "fail":
        services.run_fail(run_id=run.pk, code="worker_lost", message="gone")
    else:
        services.run_cancel(run_id=run.pk, reason="not needed")
    run.refresh_from_db()
    assert run.status in ("completed", "failed", "cancelled")
    artifact.refresh_from_db()
    assert artifact.expires_at is not None
    assert timedelta(days=6, hours=23) < artifact.expires_at - timezone.now() <= timedelta(days=7)
