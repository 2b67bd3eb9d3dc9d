"""Edit and retry: a failed run's new attempt runs an edited plan (API, admin runbook, command)."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from core.models import AuditRecord
from runs import services
from runs.invariants import invariants_check
from runs.models import Run
from tests.conftest import make_plan
from tests.drive import drain_jobs

pytestmark = pytest.mark.django_db(transaction=True)

FATAL = make_plan(tool="fail", args={"mode": "fatal"})
FIXED = make_plan(tool="echo", args={"text": "fixed"})
GATED = {"agents": [{"name": "p", "tasks": [{"name": "phase_one", "steps": [
    {"name": "IG_one", "kind": "check", "check": "expect", "args": {"value": 1, "equals": 1}},
    {"name": "work", "tool": "fail", "args": {"mode": "fatal"}}]}]}]}


@pytest.fixture(autouse=True)
def no_wake_messages(monkeypatch):
    monkeypatch.setattr("jobs.wake._send", lambda count: None)


def settle(run_id: int) -> Run:
    ended = (Run.Status.COMPLETED, Run.Status.FAILED, Run.Status.CANCELLED)
    drain_jobs(until=lambda: Run.objects.get(pk=run_id).status in ended, timeout=20)
    run = Run.objects.get(pk=run_id)
    assert invariants_check() == []
    return run


def failed_run(project, plan=FATAL) -> Run:
    run = services.run_create(project=project, name="to edit", plan=plan)
    services.run_start(run_id=run.pk)
    run = settle(run.pk)
    assert run.status == Run.Status.FAILED
    return run


@pytest.fixture
def owner_client(org):
    client = APIClient()
    client.force_authenticate(org.memberships.get().user)
    return client


def test_a_fatal_run_retried_with_an_edited_plan_through_the_api_completes(project, owner_client):
    run = failed_run(project)
    response = owner_client.post(f"/api/v1/runs/{run.pk}/retry/", {"plan": FIXED, "reason": "use echo"},
                                 format="json")
    assert response.status_code == 200, response.content
    run = settle(run.pk)
    assert (run.status, run.attempt_number, run.plan) == (Run.Status.COMPLETED, 2, FIXED)
    audit = AuditRecord.objects.get(action="run_retry", run_id=run.pk)
    assert audit.reason == "use echo"
    assert audit.before["plan"] == FATAL and audit.after["plan"] == FIXED
    assert any(line.startswith("agents[0].tasks[0].steps[0].tool: 'fail' → 'echo'") for line in audit.after["plan_diff"])


def test_an_edited_plan_is_validated_like_a_new_one(project, owner_client, settings):
    run = failed_run(project)
    url = f"/api/v1/runs/{run.pk}/retry/"
    bad = owner_client.post(url, {"plan": {"agents": []}}, format="json")
    assert (bad.status_code, bad.json()["code"]) == (400, "validation_error")
    settings.ORCHESTRATOR_PLAN_MAX_STEPS = 2
    too_big = owner_client.post(url, {"plan": make_plan(steps=3)}, format="json")
    assert (too_big.status_code, too_big.json()["code"]) == (400, "validation_error")
    settings.ORCHESTRATOR_PLAN_MAX_STEPS = 1000
    dear = owner_client.post(url, {"plan": make_plan(steps=run.credit_limit + 1)}, format="json")
    assert dear.status_code == 400 and "credit_limit" in dear.json()["errors"]["plan"][0]
    assert Run.objects.get(pk=run.pk).status == Run.Status.FAILED and Run.objects.get(pk=run.pk).plan == FATAL


def test_a_gated_runs_plan_cannot_be_edited(project, owner_client, operator):
    run = failed_run(project, GATED)
    assert run.gated
    response = owner_client.post(f"/api/v1/runs/{run.pk}/retry/", {"plan": FIXED}, format="json")
    assert (response.status_code, response.json()["code"]) == (409, "plan_is_contract")
    with pytest.raises(CommandError, match="plan_is_contract"):
        call_command("retry_run", str(run.pk), "--reason", "edit", "--plan-file", _plan_file(FIXED),
                     stdout=StringIO(), stderr=StringIO())
    run.refresh_from_db()
    assert (run.status, run.attempt_number, run.plan) == (Run.Status.FAILED, 1, GATED)


_tmp = {}


def _plan_file(plan) -> str:
    path = _tmp["dir"] / "plan.json"
    path.write_text(json.dumps(plan) if not isinstance(plan, str) else plan)
    return str(path)


@pytest.fixture(autouse=True)
def plan_dir(tmp_path):
    _tmp["dir"] = tmp_path


def test_the_retry_command_takes_an_edited_plan_file(project):
    run = failed_run(project)
    with pytest.raises(CommandError, match="not valid JSON"):
        call_command("retry_run", str(run.pk), "--reason", "edit", "--plan-file", _plan_file("{nope"),
                     stdout=StringIO(), stderr=StringIO())
    with pytest.raises(CommandError, match="agents"):
        call_command("retry_run", str(run.pk), "--reason", "edit", "--plan-file", _plan_file({"agents": []}),
                     stdout=StringIO(), stderr=StringIO())
    with pytest.raises(CommandError, match="--plan-file"):
        call_command("retry_run", str(run.pk), "--reason", "edit", "--plan-file", "/nonexistent/plan.json",
                     stdout=StringIO(), stderr=StringIO())
    out = StringIO()
    call_command("retry_run", str(run.pk), "--reason", "echo instead", "--plan-file", _plan_file(FIXED), stdout=out,
                 stderr=StringIO())
    assert "failed → retrying" in out.getvalue()
    run = settle(run.pk)
    assert (run.status, run.attempt_number, run.plan) == (Run.Status.COMPLETED, 2, FIXED)
    assert AuditRecord.objects.get(action="run_retry", run_id=run.pk).after["plan"] == FIXED
