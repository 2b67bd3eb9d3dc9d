"""Jobs through the API: enqueue (202 or wait-or-202), get, list, cancel, and their error codes."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.test import override_settings

from core.services import project_create
from jobs.models import CommandRecord, Job, WorkerSession
from jobs.services import job_claim, job_complete
from runs import services
from tests.api.conftest import assert_error, create_run
from tests.drive import drain_jobs

pytestmark = pytest.mark.django_db

SEED_003_FIELDS = {"jobId", "projectId", "jobType", "state", "attempts", "maxAttempts", "createdAt", "startedAt",
                   "completedAt", "error", "result"}


def enqueue(tenant, **body):
    return tenant.client.post("/api/v1/jobs/", {"type": "noop", "project": tenant.project.pk, "payload": {},
                                                **body}, format="json")


def test_enqueue_answers_202_queued_in_seed_003_names(tenant):
    response = enqueue(tenant, payload={"value": 7})
    assert response.status_code == 202
    body = response.json()
    assert SEED_003_FIELDS <= set(body)
    assert (body["status"], body["dedupe"], body["state"], body["jobType"]) == ("queued", "enqueued", "queued", "noop")
    assert body["projectId"] == tenant.project.pk
    job = Job.objects.get(pk=body["jobId"])
    assert job.payload == {"value": 7} and job.organization_id == tenant.organization.pk


def test_enqueue_validates_type_payload_and_project(tenant):
    body = assert_error(enqueue(tenant, type="run_tick", payload={"run": 1}), 400, "validation_error")
    assert "type" in body["errors"]
    body = assert_error(enqueue(tenant, type="nope"), 400, "validation_error")
    assert "type" in body["errors"]
    body = assert_error(enqueue(tenant, payload={"sleep": "long"}), 400, "validation_error")
    assert "payload.sleep" in body["errors"]
    body = assert_error(enqueue(tenant, payload=[1]), 400, "validation_error")
    assert "payload" in body["errors"]
    body = assert_error(enqueue(tenant, type="command", payload={"command": ["x"]}), 400, "validation_error")
    assert_error(enqueue(tenant, project=999999), 404, "not_found")
    assert_error(enqueue(tenant, wait_ms=-1), 400, "validation_error")
    assert Job.objects.count() == 0


def test_get_list_and_filter_jobs(tenant):
    first = enqueue(tenant).json()["jobId"]
    second = enqueue(tenant, type="probe").json()["jobId"]
    job = tenant.client.get(f"/api/v1/jobs/{first}/").json()
    assert job["jobId"] == first and SEED_003_FIELDS <= set(job)

    def ids(query):
        response = tenant.client.get(f"/api/v1/jobs/{query}")
        assert response.status_code == 200, response.content
        return [row["jobId"] for row in response.json()["results"]]

    assert ids("") == [second, first]
    assert ids(f"?project={tenant.project.pk}&type=probe") == [second]
    assert ids("?state=queued") == [second, first]
    assert ids("?state=completed") == []
    assert_error(tenant.client.get("/api/v1/jobs/?state=bogus"), 400, "validation_error")
    assert_error(tenant.client.get("/api/v1/jobs/?project=999999"), 404, "not_found")
    assert_error(tenant.client.get("/api/v1/jobs/999999/"), 404, "not_found")


def test_cancel_a_queued_job_then_a_finished_one_is_409(tenant):
    queued = enqueue(tenant).json()["jobId"]
    response = tenant.client.post(f"/api/v1/jobs/{queued}/cancel/", {"reason": "not needed"}, format="json")
    assert response.status_code == 200 and response.json()["state"] == "cancelled"
    assert tenant.client.post(f"/api/v1/jobs/{queued}/cancel/", format="json").json()["state"] == "cancelled"
    done = enqueue(tenant).json()["jobId"]
    claimed = job_claim(worker="test")
    job_complete(job_id=claimed.pk, attempt=claimed.attempts, result={"ok": True})
    assert claimed.pk == done
    body = assert_error(tenant.client.post(f"/api/v1/jobs/{done}/cancel/", format="json"), 409, "job_conflict")
    assert (body["from"], body["to"]) == ("completed", "cancelled")


def test_jobs_of_the_run_engine_cannot_be_cancelled_here(tenant, django_capture_on_commit_callbacks):
    run = create_run(tenant)
    with django_capture_on_commit_callbacks(execute=True):
        tenant.client.post(f"/api/v1/runs/{run['id']}/start/", format="json")
    tick = Job.objects.get(run_id=run["id"])  # the run_step job that starts the run
    assert_error(tenant.client.post(f"/api/v1/jobs/{tick.pk}/cancel/", format="json"), 403, "permission_denied")
    assert tenant.client.get(f"/api/v1/jobs/{tick.pk}/").json()["runId"] == run["id"]


@override_settings(ORCHESTRATOR_QUEUE_MAX_PER_PROJECT=1)
def test_a_full_queue_is_429_with_retry_after(tenant):
    assert enqueue(tenant).status_code == 202
    response = enqueue(tenant)
    body = assert_error(response, 429, "queue_full")
    assert int(response["Retry-After"]) == body["retry_after"] >= 1 and body["scope"] == "project"


@override_settings(ORCHESTRATOR_QUEUE_ORG_MAX_WAITING=2)
def test_an_organization_over_its_waiting_cap_is_429_while_another_enqueues(tenant, other):
    second = project_create(organization=tenant.organization, name="second")
    for project in (tenant.project.pk, second.pk):  # each project is under its own cap
        assert enqueue(tenant, project=project).status_code == 202
    response = enqueue(tenant)
    body = assert_error(response, 429, "queue_full")
    assert int(response["Retry-After"]) == body["retry_after"] >= 1 and body["scope"] == "organization"
    assert enqueue(other).status_code == 202  # another organization is not held back


@pytest.mark.parametrize("lane", ["x" * 201, "x" * 5000, "line\nbreak", "ctl\u0001", 12,
                                  {"nested": "run:1"}])
def test_a_bad_payload_lane_is_400_naming_the_field_never_500(tenant, lane):
    body = assert_error(enqueue(tenant, payload={"lane": lane}), 400, "validation_error")
    assert "payload.lane" in body["errors"]
    assert Job.objects.count() == 0


def test_a_payload_lane_cannot_name_another_tenants_lane(tenant, other):
    response = enqueue(tenant, payload={"lane": f"project:{other.project.pk}"})
    assert response.status_code == 202
    assert response.json()["lane"] == f"project:{tenant.project.pk}:user:project:{other.project.pk}"
    hostile = job_claim(worker="w1")
    assert hostile.pk == response.json()["jobId"]
    victim = other.client.post("/api/v1/jobs/", {"type": "command", "project": other.project.pk, "payload": {
        "command": "create_deployment", "args": {"name": "web"}, "idempotency_key": "k"}}, format="json")
    assert victim.status_code == 202 and victim.json()["lane"] == f"project:{other.project.pk}"
    assert job_claim(worker="w2").pk == victim.json()["jobId"]  # its project lane was free


@override_settings(ORCHESTRATOR_QUEUE_ENABLED=False)
def test_a_disabled_queue_is_503(tenant):
    assert_error(enqueue(tenant), 503, "queue_disabled")


def test_a_system_owned_source_session_is_refused_403(tenant, other):
    WorkerSession.objects.create(key=f"project:{tenant.project.pk}::helper", owner=f"project:{tenant.project.pk}",
                                 agent="helper", project=tenant.project, system_owned=True)
    body = assert_error(enqueue(tenant, sourceSessionId=f"project:{tenant.project.pk}::helper"), 403,
                        "system_session")
    assert body["session"] == f"project:{tenant.project.pk}::helper"
    # another organization's worker session is not even there
    assert_error(enqueue(other, sourceSessionId=f"project:{tenant.project.pk}::helper"), 404, "not_found")
    response = enqueue(tenant, sourceSessionId="chat-42")  # a user session: routed as the thread
    assert response.status_code == 202
    assert (response.json()["sourceSessionId"], response.json()["threadId"]) == ("chat-42", "chat-42")
    assert Job.objects.count() == 1


def test_a_command_key_recorded_with_another_payload_is_409(tenant):
    from jobs.commands.services import command_execute

    command_execute(project=tenant.project, kind="create_deployment", args={"name": "web"},
                    idempotency_key="deploy-web")
    assert CommandRecord.objects.count() == 1
    body = assert_error(enqueue(tenant, type="command", payload={"command": "create_deployment",
                                                                 "args": {"name": "api"},
                                                                 "idempotency_key": "deploy-web"}),
                        409, "command_conflict")
    assert body["idempotency_key"] == "deploy-web"
    same = enqueue(tenant, type="command", payload={"command": "create_deployment", "args": {"name": "web"},
                                                    "idempotency_key": "deploy-web"})
    assert same.status_code == 202  # the same payload replays the recorded command when it runs


def test_a_tool_command_the_organization_cannot_pay_for_is_402(tenant_factory):
    from jobs.commands.services import command_execute

    broke = tenant_factory(credits=0)
    for payload in ({"tool": "echo", "args": {"text": "hi"}},
                    {"command": "invoke_tool", "args": {"tool": "http_request", "args": {"url": "http://127.0.0.1/"}},
                     "idempotency_key": "fetch-1"}):
        body = assert_error(enqueue(broke, type="command", payload=payload), 402, "insufficient_credits")
        assert body["available"] == 0 and body["required"] in (1, 2)
    assert Job.objects.count() == 0 and CommandRecord.objects.count() == 0
    # Adapter commands have no tool cost; a replay of a command already done costs nothing.
    assert enqueue(broke, type="command", payload={"command": "create_deployment", "args": {"name": "web"},
                                                   "idempotency_key": "deploy"}).status_code == 202
    command_execute(project=broke.project, kind="invoke_tool", args={"tool": "echo", "args": {"text": "hi"}},
                    idempotency_key="done-before")
    replay = enqueue(broke, type="command", payload={"command": "invoke_tool", "idempotency_key": "done-before",
                                                     "args": {"tool": "echo", "args": {"text": "hi"}}})
    assert replay.status_code == 202


def test_wait_ms_times_out_into_202(tenant, settings):
    settings.ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS = 50
    response = enqueue(tenant, wait_ms=10_000)  # capped at 50 ms
    assert response.status_code == 202 and response.json()["status"] == "queued"


@pytest.mark.django_db(transaction=True)
def test_wait_ms_answers_the_result_when_a_worker_finishes_in_time(tenant, settings):
    settings.ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS = 10_000
    errors: list[BaseException] = []

    def worker():
        try:
            drain_jobs(until=lambda: Job.objects.filter(state="completed").exists(), timeout=10, worker="thread")
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        response = enqueue(tenant, payload={"value": "hello"}, wait_ms=8_000)
    finally:
        thread.join(15)
    assert not errors
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["status"], body["state"]) == ("completed", "completed")
    assert body["result"] == {"echo": "hello", "attempt": 1}


def test_engine_job_results_show_the_run(tenant, django_capture_on_commit_callbacks):
    run = create_run(tenant)
    with django_capture_on_commit_callbacks(execute=True):
        tenant.client.post(f"/api/v1/runs/{run['id']}/start/", format="json")
    services.run_cancel(run_id=run["id"])
    rows = tenant.client.get("/api/v1/jobs/?type=run_step").json()["results"]  # the job that starts it
    assert [row["runId"] for row in rows] == [run["id"]]
