"""The sidecar export (seed 002 §5): it validates against the schema kept in the repository for a
completed, a stopped and a failed run, and ``export_run`` prints or writes it."""

from __future__ import annotations

import json
from io import StringIO

import jsonschema
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from runs.pipeline.sidecar import sidecar_build, sidecar_schema
from tests.runs.test_gates import check, drive, files, sha256, small_plan, start  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def no_wake_messages(monkeypatch):
    monkeypatch.setattr("jobs.wake._send", lambda count: None)


def valid(document: dict) -> dict:
    jsonschema.Draft202012Validator.check_schema(sidecar_schema())
    jsonschema.Draft202012Validator(sidecar_schema()).validate(document)
    return document


def test_the_sidecar_of_a_completed_run(project, files):
    manifest, _ = files
    run = drive(start(project, small_plan(manifest)))
    document = valid(sidecar_build(run))
    assert (document["run_id"], document["state"], document["mode"], document["schema_version"]) == (
        str(run.pk), "completed", "live", 1)
    assert list(document["phases"]) == ["phase_one", "phase_two", "phase_three"]
    assert {phase["result"] for phase in document["phases"].values()} == {"passed"}
    assert document["phases"]["phase_one"]["gate_invariants"] == {"IG_one.equals": True}
    assert document["phases"]["phase_three"]["receipts"][0]["check"] == "ledger_balanced"
    assert document["context_pins"] == {"manifest": sha256(manifest)}
    assert document["idempotency_keys"] == {name: f"run:{run.pk}:phase:{name}"
                                            for name in ("phase_one", "phase_two", "phase_three")}
    assert document["last_error"] is None and document["created_by"] == "system"


def test_the_sidecar_of_runs_stopped_for_approval_and_on_drift(project, files, operator):
    manifest, _ = files
    waiting = drive(start(project, small_plan(manifest, middle={"name": "ask", "kind": "approval",
                                                                 "gate": "SG_go"})))
    document = valid(sidecar_build(waiting))
    assert (document["state"], document["status_reason"]) == ("paused", "awaiting_approval:SG_go")
    assert document["pending_approvals"][0]["gate"] == "SG_go" and document["sovereign_approvals"] == []
    assert document["phases"]["phase_two"]["result"] == "running"

    drifting = drive(start(project, small_plan(manifest)),
                     until=lambda r: r.gate_receipts.filter(gate="IG_one").exists())
    manifest.write_text("moved on\n")
    drifting = drive(drifting)
    from runs import services

    services.drift_acknowledge(run_id=drifting.pk, actor=operator, reason="accepted")
    document = valid(sidecar_build(drifting))
    assert document["status_reason"] == "stopped_drift:manifest"
    assert document["drift"][0]["status"] == "acknowledged" and document["drift"][0]["acknowledged_by"] == "op"
    assert [(p["source"], p["superseded_utc"] is None) for p in document["context_pin_history"]] == [
        ("start", False), ("acknowledged", True)]
    assert document["context_pins"] == {"manifest": sha256(manifest)}


def test_the_sidecar_of_a_failed_run_names_the_gate_and_invariant(project, files):
    manifest, _ = files
    run = drive(start(project, small_plan(manifest, middle=check("IG_count", "expect", value=4, equals=5))))
    document = valid(sidecar_build(run))
    assert document["state"] == "failed"
    assert document["last_error"]["code"] == "gate_failed:IG_count"
    assert (document["last_error"]["gate"], document["last_error"]["invariants"]) == ("IG_count", ["equals"])
    assert document["phases"]["phase_two"]["result"] == "failed"
    assert document["phases"]["phase_two"]["gate_invariants"] == {"IG_count.equals": False}


def test_export_run_prints_validates_and_writes_the_sidecar(project, files, tmp_path):
    manifest, _ = files
    run = drive(start(project, small_plan(manifest), mode="dryrun"))
    out = StringIO()
    call_command("export_run", str(run.pk), "--validate", stdout=out)
    document = valid(json.loads(out.getvalue()))
    assert document["mode"] == "dryrun" and document["run_id"] == str(run.pk)
    target = tmp_path / "state.json"
    out = StringIO()
    call_command("export_run", str(run.pk), "--output", str(target), stdout=out)
    assert out.getvalue().strip() == f"run {run.pk}: sidecar written to {target}"
    assert valid(json.loads(target.read_text()))["phases"].keys() == document["phases"].keys()
    with pytest.raises(CommandError, match="run 999999 does not exist"):
        call_command("export_run", "999999", stdout=StringIO())
    with pytest.raises(CommandError, match="cannot write"):
        call_command("export_run", str(run.pk), "--output", str(tmp_path / "missing" / "x.json"), stdout=StringIO())
