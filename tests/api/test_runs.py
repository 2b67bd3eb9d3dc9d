"""Runs through the API: create, list and filter, detail, actions, approvals, delete, events."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import LedgerEntry
from billing.selectors import account_balance
from runs import services
from runs.models import Run
from tests.api.conftest import assert_error, create_run
from tests.conftest import make_plan
from tests.drive import drain_jobs

pytestmark = pytest.mark.django_db


def test_create_answers_201_with_the_run(tenant):
    response = tenant.client.post("/api/v1/runs/", tenant.run_body(priority=5, max_attempts=2, credit_limit=50),
                                  format="json")
    assert response.status_code == 201
    body = response.json()
    run = Run.objects.get(pk=body["id"])
    assert (body["status"], body["priority"], body["max_attempts"], body["credit_limit"]) == ("created", 5, 2, 50)
    assert body["organization"] == tenant.organization.pk and body["project"] == tenant.project.pk
    assert body["attempt_number"] == 1 and body["last_error"] is None
    assert body["counts"] == {level: {s: 0 for s in ["pending", "running", "paused", "completed", "failed",
                                                      "skipped", "cancelled"]}
                              for level in ("agents", "tasks", "steps")}
    assert body["plan"] == run.plan and run.created_by == tenant.user


def test_create_reports_every_field_error(tenant):
    bad_plan = {"agents": [{"name": "", "tasks": [{"name": "t", "steps": [{"name": "s", "tool": "nope"}]}]}]}
    response = tenant.client.post("/api/v1/runs/", {"project": tenant.project.pk, "name": "x", "plan": bad_plan,
                                                    "priority": 5000}, format="json")
    body = assert_error(response, 400, "validation_error")
    assert "priority" in body["errors"]
    response = tenant.client.post("/api/v1/runs/", {"project": tenant.project.pk, "name": "x", "plan": bad_plan},
                                  format="json")
    body = assert_error(response, 400, "validation_error")
    assert set(body["errors"]) == {"agents[0].name", "agents[0].tasks[0].steps[0].tool"}
    body = assert_error(tenant.client.post("/api/v1/runs/", {}, format="json"), 400, "validation_error")
    assert {"project", "name", "plan"} <= set(body["errors"])
    body = assert_error(tenant.client.post("/api/v1/runs/", [1, 2], format="json"), 400, "validation_error")
    assert Run.objects.count() == 0


def test_create_without_enough_credits_is_402_and_writes_nothing(tenant_factory):
    poor = tenant_factory(credits=2)
    body = assert_error(poor.client.post("/api/v1/runs/", poor.run_body(credit_limit=10), format="json"),
                        402, "insufficient_credits")
    assert body["available"] == 2 and body["required"] == 10
    assert Run.objects.count() == 0


def test_start_without_enough_credits_is_402_and_leaves_the_run_created(tenant_factory):
    tenant = tenant_factory(credits=10)
    first = create_run(tenant, credit_limit=10)
    second = create_run(tenant, credit_limit=10)
    assert tenant.client.post(f"/api/v1/runs/{first['id']}/start/", format="json").status_code == 200
    assert_error(tenant.client.post(f"/api/v1/runs/{second['id']}/start/", format="json"), 402,
                 "insufficient_credits")
    assert Run.objects.get(pk=second["id"]).status == Run.Status.CREATED


def test_list_filters_by_project_status_and_created_range(tenant):
    from core.services import project_create

    second_project = project_create(organization=tenant.organization, name="second")
    first = create_run(tenant)
    second = create_run(tenant, project=second_project.pk)
    tenant.client.post(f"/api/v1/runs/{first['id']}/start/", format="json")

    def ids(query: str) -> list[int]:
        response = tenant.client.get(f"/api/v1/runs/{query}")
        assert response.status_code == 200, response.content
        return [run["id"] for run in response.json()["results"]]

    assert ids("") == [second["id"], first["id"]]
    assert ids(f"?project={second_project.pk}") == [second["id"]]
    assert ids("?status=pending") == [first["id"]]
    assert ids("?status=created") == [second["id"]]
    future = (timezone.now() + timedelta(hours=1)).isoformat().replace("+00:00", "Z")
    past = (timezone.now() - timedelta(hours=1)).isoformat().replace("+00:00", "Z")
    assert ids(f"?created_after={past}&created_before={future}") == [second["id"], first["id"]]
    assert ids(f"?created_after={future}") == []
    body = assert_error(tenant.client.get("/api/v1/runs/?status=bogus"), 400, "validation_error")
    assert "status" in body["errors"]
    assert_error(tenant.client.get("/api/v1/runs/?created_after=yesterday"), 400, "validation_error")
    assert_error(tenant.client.get("/api/v1/runs/?project=abc"), 400, "validation_error")
    assert_error(tenant.client.get("/api/v1/runs/?project=999999"), 404, "not_found")


def test_list_is_paginated(tenant):
    for _ in range(3):
        create_run(tenant)
    page = tenant.client.get("/api/v1/runs/?page_size=2").json()
    assert page["count"] == 3 and len(page["results"]) == 2 and page["next"]
    assert len(tenant.client.get(page["next"]).json()["results"]) == 1
    assert_error(tenant.client.get("/api/v1/runs/?page=9"), 404, "not_found")


def test_detail_counts_agents_tasks_and_steps_by_status(tenant, django_capture_on_commit_callbacks):
    run = create_run(tenant, plan=make_plan(agents=2, tasks=2, steps=3))
    with django_capture_on_commit_callbacks(execute=True):
        tenant.client.post(f"/api/v1/runs/{run['id']}/start/", format="json")
    services.run_mark_running(run_id=run["id"])
    body = tenant.client.get(f"/api/v1/runs/{run['id']}/").json()
    assert body["status"] == "running" and body["started_at"]
    assert body["counts"]["agents"]["pending"] == 2
    assert body["counts"]["tasks"]["pending"] == 4
    assert body["counts"]["steps"]["pending"] == 12
    assert body["credits_reserved"] == body["credit_limit"]


def test_actions_move_the_run_and_answer_it(tenant):
    run = create_run(tenant)
    url = f"/api/v1/runs/{run['id']}"
    response = tenant.client.post(f"{url}/start/", {"reason": "go"}, format="json")
    assert response.status_code == 200 and response.json()["status"] == "pending"
    services.run_mark_running(run_id=run["id"])
    assert tenant.client.post(f"{url}/pause/", format="json").json()["status"] == "paused"
    assert tenant.client.post(f"{url}/pause/", format="json").json()["status"] == "paused"  # already: no-op
    assert tenant.client.post(f"{url}/resume/", format="json").json()["status"] == "resuming"
    services.run_mark_running(run_id=run["id"])  # a worker picks it up again
    cancelled = tenant.client.post(f"{url}/cancel/", {"reason": "enough"}, format="json").json()
    assert cancelled["status"] == "cancelled" and cancelled["cancelled_at"]
    assert cancelled["credits_refunded"] == cancelled["credits_reserved"]
    assert account_balance(organization_id=tenant.organization.pk)["reserved"] == 0


def test_a_forbidden_transition_is_409_with_from_and_to(tenant):
    run = create_run(tenant)
    body = assert_error(tenant.client.post(f"/api/v1/runs/{run['id']}/resume/", format="json"), 409,
                        "invalid_transition")
    assert (body["from"], body["to"]) == ("created", "resume")
    body = assert_error(tenant.client.post(f"/api/v1/runs/{run['id']}/retry/", format="json"), 409,
                        "invalid_transition")
    assert (body["from"], body["to"]) == ("created", "retry")
    tenant.client.post(f"/api/v1/runs/{run['id']}/cancel/", format="json")
    assert_error(tenant.client.post(f"/api/v1/runs/{run['id']}/start/", format="json"), 409, "invalid_transition")


def test_retry_a_failed_run_makes_a_new_attempt(tenant):
    run = create_run(tenant, max_attempts=2)
    tenant.client.post(f"/api/v1/runs/{run['id']}/start/", format="json")
    services.run_fail(run_id=run["id"], code="drill", message="failed on purpose")
    failed = tenant.client.get(f"/api/v1/runs/{run['id']}/").json()
    assert failed["last_error"] == {"code": "drill", "message": "failed on purpose"}
    retried = tenant.client.post(f"/api/v1/runs/{run['id']}/retry/", format="json").json()
    assert (retried["status"], retried["attempt_number"]) == ("retrying", 2)
    assert LedgerEntry.objects.filter(run_id=run["id"], kind="reserve").count() == 2


def test_action_bodies_are_validated(tenant):
    run = create_run(tenant)
    body = assert_error(tenant.client.post(f"/api/v1/runs/{run['id']}/start/", {"reason": 5 * "x" * 300},
                                           format="json"), 400, "validation_error")
    assert "reason" in body["errors"]
    body = assert_error(tenant.client.post(f"/api/v1/runs/{run['id']}/approve/", {}, format="json"), 400,
                        "validation_error")
    assert {"gate", "approval_ref"} <= set(body["errors"])


def test_delete_a_created_run_then_it_is_gone(tenant):
    run = create_run(tenant)
    started = create_run(tenant)
    tenant.client.post(f"/api/v1/runs/{started['id']}/start/", format="json")
    assert tenant.client.delete(f"/api/v1/runs/{run['id']}/").status_code == 204
    assert_error(tenant.client.get(f"/api/v1/runs/{run['id']}/"), 404, "not_found")
    assert_error(tenant.client.delete(f"/api/v1/runs/{started['id']}/"), 409, "invalid_transition")


def test_run_events_after_an_id(tenant):
    run = create_run(tenant)
    tenant.client.post(f"/api/v1/runs/{run['id']}/start/", format="json")
    page = tenant.client.get(f"/api/v1/runs/{run['id']}/events/").json()
    assert [event["type"] for event in page["results"]] == ["run_created", "ledger_reserve", "run_pending",
                                                            "orchestrator_job_queued"]  # its tick, queued with it
    assert all(event["run"] == run["id"] for event in page["results"])
    assert page["next"] is None and page["last_id"] == page["results"][-1]["id"]
    later = tenant.client.get(f"/api/v1/runs/{run['id']}/events/?after={page['results'][0]['id']}").json()
    assert [event["type"] for event in later["results"]] == ["ledger_reserve", "run_pending", "orchestrator_job_queued"]
    one = tenant.client.get(f"/api/v1/runs/{run['id']}/events/?limit=1").json()
    assert len(one["results"]) == 1 and "after=" in one["next"] and one["last_id"] == page["results"][0]["id"]
    assert_error(tenant.client.get(f"/api/v1/runs/{run['id']}/events/?limit=0"), 400, "validation_error")


APPROVAL_PLAN = {"agents": [{"name": "a", "tasks": [
    {"name": "t", "steps": [{"name": "hello", "tool": "echo", "args": {"text": "hi"}},
                            {"name": "gate", "kind": "approval", "gate": "publish"}]}]}]}


def _paused_at_gate(tenant) -> int:
    run = create_run(tenant, plan=APPROVAL_PLAN)
    tenant.client.post(f"/api/v1/runs/{run['id']}/start/", format="json")
    drain_jobs(until=lambda: Run.objects.get(pk=run["id"]).status_reason == "awaiting_approval:publish")
    return run["id"]


@pytest.mark.django_db(transaction=True)
def test_approve_a_gate_resumes_the_run_and_a_reference_is_used_once(tenant):
    run_id = _paused_at_gate(tenant)
    body = tenant.client.get(f"/api/v1/runs/{run_id}/").json()
    assert (body["status"], body["status_reason"]) == ("paused", "awaiting_approval:publish")
    assert_error(tenant.client.post(f"/api/v1/runs/{run_id}/approve/", {"gate": "other", "approval_ref": "CAB-1"},
                                    format="json"), 409, "approval_not_pending")
    approved = tenant.client.post(f"/api/v1/runs/{run_id}/approve/",
                                  {"gate": "publish", "approval_ref": "CAB-1", "reason": "ok"}, format="json")
    assert approved.status_code == 200 and approved.json()["status"] == "resuming"
    drain_jobs(until=lambda: Run.objects.get(pk=run_id).status == Run.Status.COMPLETED)
    second = _paused_at_gate(tenant)
    assert_error(tenant.client.post(f"/api/v1/runs/{second}/approve/", {"gate": "publish", "approval_ref": "CAB-1"},
                                    format="json"), 409, "approval_reused")


def _plan_with(agent=None, task=None, step=None) -> dict:
    step = {"name": "s", "tool": "echo", "args": {"text": "x"}, **(step or {})}
    task = {"name": "t", "steps": [step], **(task or {})}
    return {"agents": [{"name": "a", "tasks": [task], **(agent or {})}]}


@pytest.mark.parametrize("plan, field", [
    (_plan_with(agent={"failure_mode": []}), "agents[0].failure_mode"),
    (_plan_with(task={"parallelism_mode": {"x": 1}}), "agents[0].tasks[0].parallelism_mode"),
    (_plan_with(task={"depends_on": 5}), "agents[0].tasks[0].depends_on"),
    (_plan_with(task={"depends_on": [[1]]}), "agents[0].tasks[0].depends_on"),
    (_plan_with(step={"kind": ["tool"]}), "agents[0].tasks[0].steps[0].kind"),
    (_plan_with(step={"tool": "http_request", "args": {"url": "http://["}}), "agents[0].tasks[0].steps[0].args"),
])
def test_malformed_plans_are_field_errors_not_500(tenant, plan, field):
    body = assert_error(tenant.client.post("/api/v1/runs/", tenant.run_body(plan=plan), format="json"), 400,
                        "validation_error")
    assert field in body["errors"], body["errors"]
