"""Gated pipelines in the console: acknowledge drift, resume (with an approval) and void from the
admin with a reason and their permissions, the sidecar download and the pipeline panel, the
Operators group, and the same runbooks from the shell (``acknowledge_drift``, ``resume_run``,
``void_run``) with ``--reason``, ``--dry-run``, ``--as`` and ``--json``."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib import messages
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Group
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import reverse

from core.models import AuditRecord
from runs import services
from runs.pipeline import gates
from runs.models import ContextPin, DriftRecord, PipelineKey, Run, Step
from tests.console.test_actions import act, action_choices, reported

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(operator):
    """The shared ``op`` user, in the Operators group: a named ``--as`` user needs the runbook's permission."""
    from django.contrib.auth.models import Group

    operator.groups.add(Group.objects.get(name="Operators"))
    return operator


@pytest.fixture
def manifest(tmp_path, settings):
    settings.ORCHESTRATOR_PIPELINE_FILE_ROOTS = [str(tmp_path)]
    path = tmp_path / "manifest.txt"
    path.write_text("v1\n")
    return path


def _run_gate(run: Run, name: str) -> None:
    step = Step.objects.get(run=run, name=name)
    gates.gate_execute(step=step, attempt=services.step_begin(step_id=step.pk))


def gated_run(project, manifest, state: str) -> Run:
    """A gated run of three phases built through the services (no queue): ``stopped_drift`` (the
    manifest changed after IG_one), ``awaiting_approval`` (at SG_go) or ``paused`` (after IG_one)."""
    second = ({"name": "SG_go", "kind": "approval", "gate": "SG_go"} if state == "awaiting_approval"
              else {"name": "IG_two", "kind": "check", "check": "expect", "args": {"value": 2, "equals": 2}})
    plan = {"pins": {"manifest": {"provider": "file_sha256", "args": {"path": str(manifest)}}},
            "agents": [{"name": "p", "tasks": [
                {"name": "one", "idempotency_key": f"CS-{state}",
                 "steps": [{"name": "IG_one", "kind": "check", "check": "expect", "args": {"value": 1, "equals": 1}}]},
                {"name": "two", "steps": [second]},
                {"name": "three", "steps": [{"name": "IG_three", "kind": "check", "check": "ledger_balanced"}]},
            ]}]}
    run = services.run_create(project=project, name=f"gated {state}", plan=plan, credit_limit=5)
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    _run_gate(run, "IG_one")
    if state == "stopped_drift":
        manifest.write_text("v2\n")
        _run_gate(run, "IG_two")
    elif state == "awaiting_approval":
        _run_gate(run, "SG_go")
    else:
        services.run_pause(run_id=run.pk)
    run = Run.objects.get(pk=run.pk)
    assert run.status == Run.Status.PAUSED, run.status_reason
    return run


def run_command(name: str, *args: str) -> str:
    out = StringIO()
    call_command(name, *args, stdout=out, stderr=StringIO())
    return out.getvalue()


# --- the admin --------------------------------------------------------------------------------

def test_operators_may_acknowledge_drift_and_void(make_staff):
    operators = Group.objects.get(name="Operators")
    granted = {f"{p.content_type.app_label}.{p.codename}" for p in operators.permissions.all()}
    assert {"runs.acknowledge_drift", "runs.void_run", "runs.view_gatereceipt", "runs.view_contextpin",
            "runs.view_driftrecord", "runs.view_phaserecord", "runs.view_pipelinekey"} <= granted


def test_acknowledge_drift_then_resume_from_the_admin(make_staff, login, project, manifest):
    run = gated_run(project, manifest, "stopped_drift")
    assert run.status_reason == "stopped_drift:manifest"
    viewer = login(make_staff("viewer", "runs.resume_run"))
    assert "acknowledge_drift" not in action_choices(viewer)
    response = act(viewer, "resume", [run], reason="go on")
    assert "drift_unacknowledged" in reported(response)[0][1]

    user = make_staff("op", "runs.acknowledge_drift", "runs.resume_run")
    client = login(user)
    assert {"acknowledge_drift", "resume"} <= action_choices(client)
    page = act(client, "acknowledge_drift", [run], confirm=False)
    assert "manifest: recorded" in page.content.decode()
    response = act(client, "acknowledge_drift", [run], reason="v2 is the release manifest")
    assert reported(response) == [(messages.SUCCESS, f"Acknowledge drift — run {run.pk}: done: acknowledged "
                                                     "manifest; resume the run to continue")]
    pin = ContextPin.objects.get(run=run, dimension="manifest", superseded_at__isnull=True)
    assert (pin.source, pin.recorded_by, pin.reason) == ("acknowledged", user, "v2 is the release manifest")
    assert LogEntry.objects.filter(object_id=str(run.pk)).count() == 1
    response = act(client, "resume", [run], reason="go on")
    assert reported(response)[0][0] == messages.SUCCESS
    assert Run.objects.get(pk=run.pk).status == Run.Status.RESUMING
    again = act(client, "acknowledge_drift", [run], reason="again")
    assert "skipped: no unacknowledged drift" in reported(again)[0][1]


def test_resume_with_an_approval_reference_from_the_admin(make_staff, login, project, manifest):
    run = gated_run(project, manifest, "awaiting_approval")
    client = login(make_staff("op", "runs.resume_run"))
    refused = act(client, "resume", [run], reason="go")
    assert reported(refused)[0][0] == messages.ERROR and "approval_required" in reported(refused)[0][1]
    done = act(client, "resume", [run], reason="signed off", approval_ref="CAB-77")
    assert reported(done)[0][1].endswith("gate 'SG_go' approved")
    run.refresh_from_db()
    assert (run.status, run.approval_requests.get().approval_ref) == (Run.Status.RESUMING, "CAB-77")


def test_void_from_the_admin_needs_its_permission_and_a_reason(make_staff, login, project, manifest):
    run = gated_run(project, manifest, "paused")
    without = login(make_staff("almost", "runs.cancel_run", "runs.resume_run"))
    assert "void" not in action_choices(without)
    assert without.get(reverse("admin:runs_run_runbook", args=[run.pk, "void"])).status_code == 403

    client = login(make_staff("op", "runs.void_run"))
    blank = act(client, "void", [run], reason=" ")
    assert "A reason is required." in blank.content.decode()
    response = act(client, "void", [run], reason="wrong document")
    assert reported(response)[0][0] == messages.SUCCESS
    run.refresh_from_db()
    assert (run.status, run.status_reason) == (Run.Status.CANCELLED, "voided:wrong document")
    assert not PipelineKey.objects.filter(run=run, released_at__isnull=True).exists()
    assert AuditRecord.objects.get(run_id=run.pk, action="run_void").reason == "wrong document"
    again = act(client, "void", [run], reason="again")
    assert "skipped: already voided" in reported(again)[0][1]


def test_the_run_page_shows_the_pipeline_and_offers_the_sidecar(make_staff, login, project, manifest):
    run = gated_run(project, manifest, "stopped_drift")
    client = login(make_staff("viewer"))
    page = client.get(reverse("admin:runs_run_change", args=[run.pk])).content.decode()
    assert "Download the sidecar" in page and "stopped_drift:manifest" in page and "IG_one" in page
    response = client.get(reverse("admin:runs_run_sidecar", args=[run.pk]))
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    assert response["Content-Disposition"] == f'attachment; filename="run-{run.pk}-sidecar.json"'
    document = json.loads(response.content)
    assert (document["run_id"], document["status_reason"]) == (str(run.pk), "stopped_drift:manifest")
    assert client.get(reverse("admin:runs_run_sidecar", args=[999999])).status_code == 404
    for model in ("gatereceipt", "contextpin", "driftrecord", "phaserecord", "pipelinekey"):
        assert client.get(reverse(f"admin:runs_{model}_changelist")).status_code == 200


# --- the shell ----------------------------------------------------------------------------------

def test_acknowledge_drift_and_resume_run_commands(project, manifest, operator):
    run = gated_run(project, manifest, "stopped_drift")
    with pytest.raises(CommandError, match="drift_unacknowledged"):
        run_command("resume_run", str(run.pk), "--reason", "go")
    planned = run_command("acknowledge_drift", str(run.pk), "--reason", "expected", "--dry-run")
    assert planned.startswith(f"dry run: run {run.pk}: would do: acknowledges manifest: recorded")
    assert DriftRecord.objects.get(run=run).status == "open"
    done = json.loads(run_command("acknowledge_drift", str(run.pk), "--reason", "expected", "--as", "op",
                                  "--dimension", "manifest", "--json"))
    assert (done["done"], done["results"][0]["result"]) == (1, "done")
    assert DriftRecord.objects.get(run=run).acknowledged_by == operator
    assert run_command("resume_run", str(run.pk), "--reason", "go").startswith(f"run {run.pk}: done: ")
    assert run_command("resume_run", str(run.pk), "--reason", "go").startswith(f"run {run.pk}: skipped: already")


def test_resume_run_with_an_approval_reference(project, manifest):
    run = gated_run(project, manifest, "awaiting_approval")
    with pytest.raises(CommandError, match="approval_required"):
        run_command("resume_run", str(run.pk), "--reason", "go")
    with pytest.raises(CommandError, match="--gate needs --approval-ref"):
        run_command("resume_run", str(run.pk), "--reason", "go", "--gate", "SG_go")
    out = run_command("resume_run", str(run.pk), "--reason", "go", "--approval-ref", "KB-5")
    assert out.startswith(f"run {run.pk}: done: paused (awaiting_approval:SG_go) → resuming")


def test_void_run_command(project, manifest):
    run = gated_run(project, manifest, "paused")
    planned = run_command("void_run", str(run.pk), "--reason", "superseded", "--dry-run")
    assert "would do: paused → cancelled (voided:<reason>); releases 3 phase keys" in planned
    assert Run.objects.get(pk=run.pk).status == Run.Status.PAUSED
    out = run_command("void_run", str(run.pk), "--reason", "superseded")
    assert out.startswith(f"run {run.pk}: done: paused → cancelled (voided:superseded)")
    assert run_command("void_run", str(run.pk), "--reason", "x").startswith(f"run {run.pk}: skipped: already voided")
    running = services.run_create(project=project, name="plain", plan={"agents": [{"name": "a", "tasks": [
        {"name": "t", "steps": [{"name": "s", "tool": "echo", "args": {"text": "x"}}]}]}]})
    with pytest.raises(CommandError, match="only a stopped run"):
        run_command("void_run", str(running.pk), "--reason", "x")
    with pytest.raises(CommandError, match="--reason"):
        run_command("void_run", str(run.pk))
