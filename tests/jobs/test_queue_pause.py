"""Pausable queues: a paused queue keeps its jobs queued and unclaimed while the others are served;
resuming continues in order. Through the services, the commands, the admin and the API."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from rest_framework.authtoken.models import Token

from core.models import AuditRecord, Event, Membership
from jobs.errors import QueuePauseConflict
from jobs.models import Job, JobState, QueuePause
from jobs.selectors import job_wait_explain
from jobs.services import job_claim, job_complete, job_enqueue, jobs_eligible, queue_pause, queue_resume
from tests.api import conftest as api_fixtures
from tests.api.conftest import assert_error, token_client

pytestmark = pytest.mark.django_db
tenant_factory = api_fixtures.tenant_factory  # the API's tenants: organization, project, owner, token client


@pytest.fixture(autouse=True)
def wide_pool(settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 20


def _enqueue(project, n: int, job_type: str = "noop") -> list[int]:
    return [job_enqueue(job_type=job_type, project=project, payload={"value": i}).job.pk for i in range(n)]


def _drain(worker: str = "w") -> list[int]:
    claimed = []
    while (job := job_claim(worker=worker)) is not None:
        claimed.append(job.pk)
        job_complete(job_id=job.pk, attempt=job.attempts)
    return claimed


def test_a_paused_project_keeps_its_jobs_queued_while_other_projects_are_served_then_resumes_in_order(
        org_factory, operator):
    _, paused_project, _ = org_factory()
    _, other_project, _ = org_factory()
    held = _enqueue(paused_project, 3)
    queue_pause(project_id=paused_project.pk, actor=operator, reason="maintenance window")
    held += _enqueue(paused_project, 2)  # a paused queue still accepts jobs
    served = _enqueue(other_project, 3)

    assert _drain() == served
    assert set(Job.objects.filter(pk__in=held).values_list("state", flat=True)) == {JobState.QUEUED}
    assert not jobs_eligible(pytest_now()).filter(pk__in=held).exists()

    explanation = job_wait_explain(Job.objects.get(pk=held[0]))
    assert explanation["blockers"][0]["code"] == "queue_paused"
    detail = explanation["blockers"][0]["detail"]
    assert "paused by op" in detail and "maintenance window" in detail
    assert explanation["paused"]["by"] == "op" and explanation["paused"]["reason"] == "maintenance window"
    assert explanation["position"] is None

    queue_resume(project_id=paused_project.pk, actor=operator, reason="done")
    assert _drain() == held  # in their order, nothing lost
    assert not QueuePause.objects.exists()
    actions = list(AuditRecord.objects.filter(action__startswith="queue_").order_by("id")
                   .values_list("action", "target_id", "reason"))
    assert actions == [("queue_pause", str(paused_project.pk), "maintenance window"),
                       ("queue_resume", str(paused_project.pk), "done")]
    events = list(Event.objects.filter(type__startswith="queue_").order_by("id").values_list("type", "project_id"))
    assert events == [("queue_paused", paused_project.pk), ("queue_resumed", paused_project.pk)]


def pytest_now():
    from django.utils import timezone

    return timezone.now()


def test_a_paused_job_type_is_passed_over_in_every_project(org_factory, operator):
    _, project, _ = org_factory()
    probes = _enqueue(project, 2, "probe")
    noops = _enqueue(project, 2, "noop")
    queue_pause(job_type="probe", actor=operator, reason="probe is flaky")
    assert _drain() == noops
    assert job_wait_explain(Job.objects.get(pk=probes[0]))["paused"]["job_type"] == "probe"
    queue_resume(job_type="probe", actor=operator, reason="fixed")
    assert _drain() == probes


def test_pausing_twice_or_resuming_a_running_queue_is_a_conflict_and_bad_names_are_refused(project, operator):
    queue_pause(project_id=project.pk, actor=operator, reason="x")
    with pytest.raises(QueuePauseConflict, match="already paused by op"):
        queue_pause(project_id=project.pk, actor=operator, reason="again")
    queue_resume(project_id=project.pk, actor=operator, reason="x")
    with pytest.raises(QueuePauseConflict, match="not paused"):
        queue_resume(project_id=project.pk, actor=operator, reason="x")
    from core.errors import NotFound, ValidationFailed

    with pytest.raises(ValidationFailed):
        queue_pause(job_type="no-such-type", actor=operator, reason="x")
    with pytest.raises(ValidationFailed):
        queue_pause(project_id=project.pk, job_type="noop", actor=operator, reason="x")
    with pytest.raises(ValidationFailed):
        queue_pause(project_id=project.pk, actor=operator, reason="  ")
    with pytest.raises(NotFound):
        queue_pause(project_id=987654, actor=operator, reason="x")


def test_pause_and_resume_commands(project):
    _enqueue(project, 2)
    out = StringIO()
    call_command("pause_queue", "--project", str(project.pk), "--reason", "deploy", "--dry-run", stdout=out)
    assert "would do" in out.getvalue() and not QueuePause.objects.exists()
    call_command("pause_queue", "--project", str(project.pk), "--reason", "deploy", stdout=out)
    pause = QueuePause.objects.get()
    assert pause.project_id == project.pk and pause.reason == "deploy" and pause.actor_label.startswith("shell:")
    assert job_claim(worker="w") is None
    out = StringIO()
    call_command("pause_queue", "--project", str(project.pk), "--reason", "again", stdout=out)
    assert "skipped: already paused" in out.getvalue()
    call_command("resume_queue", "--project", str(project.pk), "--reason", "deployed", stdout=StringIO())
    assert not QueuePause.objects.exists() and job_claim(worker="w") is not None

    out = StringIO()
    call_command("pause_queue", "--job-type", "probe", "--reason", "r", "--json", stdout=out)
    assert json.loads(out.getvalue())["done"] == 1 and QueuePause.objects.get().job_type == "probe"
    call_command("resume_queue", "--job-type", "probe", "--reason", "r", stdout=StringIO())
    assert not QueuePause.objects.exists()


@pytest.mark.parametrize("args, message", [
    ([], "one of the arguments --project --job-type is required"),
    (["--project", "1", "--job-type", "noop"], "not allowed with argument"),
    (["--job-type", "nope"], "'nope' is not a registered job type"),
    (["--project", "987654"], "project 987654 does not exist"),
    (["--project", "x"], "is not an id"),
])
def test_queue_commands_refuse_bad_input_with_a_clear_error(db, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("pause_queue", *args, "--reason", "r", stdout=StringIO(), stderr=StringIO())


def test_the_api_lets_an_organizations_owner_pause_and_resume_its_project_queue(tenant_factory, django_user_model):
    tenant, other = tenant_factory(), tenant_factory()
    url = f"/api/v1/projects/{tenant.project.pk}/queue/"
    member = django_user_model.objects.create_user(username="member-1")
    Membership.objects.create(organization=tenant.organization, user=member, role=Membership.Role.MEMBER)
    member_client = token_client(Token.objects.create(user=member).key)

    assert_error(member_client.post(url + "pause/", {"reason": "mine"}, format="json"), 403, "permission_denied")
    assert_error(other.client.post(url + "pause/", {"reason": "theirs"}, format="json"), 404, "not_found")
    assert_error(tenant.client.post(url + "pause/", {}, format="json"), 400, "validation_error")
    assert not QueuePause.objects.exists()

    response = tenant.client.post(url + "pause/", {"reason": "budget review"}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["paused"] is True and response.json()["by"] == tenant.user.username
    assert QueuePause.objects.get().project_id == tenant.project.pk
    assert_error(tenant.client.post(url + "pause/", {"reason": "again"}, format="json"), 409, "queue_pause_conflict")
    assert_error(member_client.post(url + "resume/", {"reason": "mine"}, format="json"), 403, "permission_denied")
    response = tenant.client.post(url + "resume/", {"reason": "reviewed"}, format="json")
    assert response.status_code == 200 and response.json()["paused"] is False
    audit = AuditRecord.objects.filter(action__startswith="queue_").order_by("id")
    assert list(audit.values_list("action", "actor_label")) == [
        ("queue_pause", tenant.user.username), ("queue_resume", tenant.user.username)]
    assert_error(tenant.client.post("/api/v1/projects/abc/queue/pause/", {"reason": "x"}, format="json"), 404,
                 "not_found")


def test_the_admin_pauses_a_project_by_action_and_a_job_type_by_its_page_and_the_dashboard_shows_them(
        project, django_user_model):
    admin_user = django_user_model.objects.create_superuser(username="root", password="pw")
    client = Client()
    client.force_login(admin_user)
    response = client.post("/admin/core/project/", {
        "action": "pause_queue", "_selected_action": [project.pk], "runbook_confirm": "pause_queue",
        "reason": "incident 7"}, follow=True)
    assert response.status_code == 200
    assert QueuePause.objects.get().project_id == project.pk
    assert AuditRecord.objects.filter(action="queue_pause", actor=admin_user, reason="incident 7").exists()
    assert "paused by root" in client.get("/admin/core/project/").content.decode()

    response = client.post("/admin/jobs/queuepause/job-type/", {"job_type": "probe", "change": "pause",
                                                                "reason": "flaky"}, follow=True)
    assert response.status_code == 200
    assert QueuePause.objects.filter(job_type="probe").exists()
    page = client.get("/admin/dashboard/").content.decode()
    assert 'data-paused-queue="project ' in page and 'data-paused-queue="job type probe"' in page
    response = client.post("/admin/jobs/queuepause/job-type/", {"job_type": "probe", "change": "resume",
                                                                "reason": ""})
    assert "A reason is required." in response.content.decode()
    assert QueuePause.objects.filter(job_type="probe").exists()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_claims_on_postgres_never_take_a_paused_queues_jobs(org_factory, settings):
    """Six threads, each with its own connection, claim at once until nothing is left: every job of
    the other project is claimed exactly once, none of the paused project's; resumed, they follow."""
    import threading

    from django.db import connection

    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 6
    _, paused_project, owner = org_factory()
    _, served_project, _ = org_factory()
    held = _enqueue(paused_project, 10)
    queue_pause(project_id=paused_project.pk, actor=owner, reason="concurrency check")
    served = _enqueue(served_project, 30)
    claimed: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def claim(index: int) -> None:
        try:
            while (job := job_claim(worker=f"w{index}")) is not None:
                with lock:
                    claimed.append(job.pk)
                job_complete(job_id=job.pk, attempt=job.attempts)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=claim, args=(i,), daemon=True) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert sorted(claimed) == sorted(served)
    assert set(Job.objects.filter(pk__in=held).values_list("state", flat=True)) == {JobState.QUEUED}
    queue_resume(project_id=paused_project.pk, actor=owner, reason="done")
    assert _drain() == held
