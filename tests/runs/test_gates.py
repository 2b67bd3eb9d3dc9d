"""Gated pipelines through the services, executed by the job queue in this process: internal
gates and their receipts, gate failures, pins and drift, caps, resume (seed 002 §7), void,
dry runs and the plan's validation."""

from __future__ import annotations

import hashlib
import http.server
import threading
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.selectors import account_balance
from core.errors import InvalidTransition, ValidationFailed
from core.models import AuditRecord, Event
from jobs.models import CommandRecord
from runs import services
from runs.pipeline import gates
from runs.services.caps import caps_enforce
from runs.invariants import invariants_check
from runs.models import (
    ApprovalRequest,
    ContextPin,
    DriftRecord,
    EscalationTicket,
    GateReceipt,
    PhaseRecord,
    PipelineKey,
    Run,
    StepAttempt,
)
from runs.pipeline.bookkeeping import DriftUnacknowledged, PipelineKeyInUse
from runs.plan import plan_validate
from tests.drive import drain_jobs

pytestmark = pytest.mark.django_db(transaction=True)

PAUSED_OR_SETTLED = {Run.Status.COMPLETED, Run.Status.FAILED, Run.Status.CANCELLED, Run.Status.PAUSED}


@pytest.fixture(autouse=True)
def no_wake_messages(monkeypatch):
    monkeypatch.setattr("jobs.wake._send", lambda count: None)


@pytest.fixture
def files(tmp_path, settings):
    """A directory that checks and pins may read, with a manifest and a backup file in it."""
    settings.ORCHESTRATOR_PIPELINE_FILE_ROOTS = [str(tmp_path)]
    manifest = tmp_path / "manifest.txt"
    manifest.write_text("doc ICX-LAW-2026-001 v3\n")
    backup = tmp_path / "pre_write.gpg"
    backup.write_bytes(b"encrypted backup")
    return manifest, backup


@pytest.fixture
def http_url(settings):
    """A local server answering 200, allow-listed by its address and port."""

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{server.server_port}"]
    yield f"http://127.0.0.1:{server.server_port}/grants"
    server.shutdown()


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check(name, check_name, **args):
    return {"name": name, "kind": "check", "check": check_name, "args": args}


def echo(name, **extra):
    return {"name": name, "tool": "echo", "args": {"text": name}, **extra}


def seed_002_plan(manifest, backup, url) -> dict:
    """Seed 002's pipeline in our plan format: 12 phases, 10 internal checks, 2 approval gates."""
    return {
        "pins": {"manifest": {"provider": "file_sha256", "args": {"path": str(manifest)}},
                 "plan_digest": {"provider": "run_field", "args": {"field": "plan_sha256"}}},
        "caps": {"run_hard_cap_minutes": 60},
        "agents": [{"name": "cutter", "tasks": [
            {"name": "source_pin", "steps": [check("IG_source_pin", "file_digest", path=str(manifest),
                                                   sha256=sha256(manifest))]},
            {"name": "mark", "steps": [echo("mark_rows"),
                                       check("IG_mark", "expect", pin="manifest", equals=sha256(manifest))]},
            {"name": "cutplan", "steps": [check("IG_cutplan", "expect", value=[3, 3], equals=[3, 3])]},
            {"name": "backup", "steps": [
                echo("write_backup", pins={"backup_sha": {"provider": "file_sha256", "args": {"path": str(backup)}}}),
                check("IG_backup", "file_digest", path=str(backup), sha256=sha256(backup))]},
            {"name": "grant_probe", "steps": [check("IG_grant_probe", "http_ok", url=url)]},
            {"name": "cut_authz", "steps": [{"name": "request", "kind": "approval", "gate": "SG_cut_authz",
                                             "args": {"question": "cut ICX-LAW-2026-001?"}}]},
            {"name": "cut_leg_a", "idempotency_key": "change-set-ICX-001", "steps": [
                echo("write_leg_a"), check("IG_cut_leg_a", "ledger_balanced")]},
            {"name": "structural_verify", "steps": [check("IG_structural_verify", "expect", pin="backup_sha",
                                                          equals=sha256(backup))]},
            {"name": "write_verify", "steps": [check("IG_write_verify", "ledger_balanced")]},
            {"name": "lifecycle_authz", "steps": [{"name": "request", "kind": "approval",
                                                   "gate": "SG_lifecycle_authz"}]},
            {"name": "lifecycle_enact", "steps": [echo("enact"), check("IG_lifecycle_enact", "ledger_balanced")]},
            {"name": "closeout", "steps": [check("IG_closeout", "expect", value="success", equals="success")]},
        ]}],
    }


def small_plan(manifest, *, middle=None, caps=None, key=None) -> dict:
    """Two gates with a tool step between them, the manifest pinned."""
    phase_two = {"name": "phase_two", "steps": [middle or echo("work"), check("IG_two", "expect", value=2, equals=2)]}
    if key:
        phase_two["idempotency_key"] = key
    plan = {"pins": {"manifest": {"provider": "file_sha256", "args": {"path": str(manifest)}}},
            "agents": [{"name": "p", "tasks": [
                {"name": "phase_one", "steps": [check("IG_one", "expect", value=1, equals=1)]},
                phase_two,
                {"name": "phase_three", "steps": [check("IG_three", "ledger_balanced")]},
            ]}]}
    if caps:
        plan["caps"] = caps
    return plan


def start(project, plan, **options):
    run = services.run_create(project=project, name="gated", plan=plan, **options)
    services.run_start(run_id=run.pk)
    return run


def drive(run, until=None, timeout=30.0):
    """Execute the run's jobs until ``until(run)`` (default: paused or settled, nothing queued)."""
    from jobs.models import ACTIVE_JOB_STATES, Job

    def done():
        current = Run.objects.get(pk=run.pk)
        if until is not None:
            return until(current)
        return (current.status in PAUSED_OR_SETTLED
                and not Job.objects.filter(run_id=run.pk, state__in=list(ACTIVE_JOB_STATES)).exists())

    drain_jobs(until=done, timeout=timeout)
    run.refresh_from_db()
    return run


def receipts(run, **filters) -> list[GateReceipt]:
    return list(GateReceipt.objects.filter(run=run, **filters).order_by("id"))


# --- internal gates ----------------------------------------------------------------------------

def test_a_seed_002_pipeline_passes_every_gate_with_a_receipt_and_waits_at_both_approvals(project, files, http_url):
    manifest, backup = files
    run = drive(start(project, seed_002_plan(manifest, backup, http_url)))
    assert (run.status, run.status_reason) == (Run.Status.PAUSED, "awaiting_approval:SG_cut_authz")
    request = ApprovalRequest.objects.get(run=run, gate="SG_cut_authz")
    assert request.asked["question"] == "cut ICX-LAW-2026-001?"
    assert request.asked["pins"] == {"backup_sha": sha256(backup), "manifest": sha256(manifest),
                                     "plan_digest": ContextPin.objects.get(run=run, dimension="plan_digest").value}
    assert [r.gate for r in receipts(run)] == ["IG_source_pin", "IG_mark", "IG_cutplan", "IG_backup",
                                               "IG_grant_probe"]

    services.approval_grant(run_id=run.pk, gate="SG_cut_authz", approval_ref="KB-CUT-1", reason="go")
    run = drive(run)
    assert run.status_reason == "awaiting_approval:SG_lifecycle_authz"
    services.approval_grant(run_id=run.pk, gate="SG_lifecycle_authz", approval_ref="KB-LIFE-1", reason="go")
    run = drive(run)
    assert run.status == Run.Status.COMPLETED

    passed = receipts(run, kind="gate")
    assert [r.gate for r in passed] == ["IG_source_pin", "IG_mark", "IG_cutplan", "IG_backup", "IG_grant_probe",
                                        "IG_cut_leg_a", "IG_structural_verify", "IG_write_verify",
                                        "IG_lifecycle_enact", "IG_closeout"]
    assert all(r.passed and r.invariants and all(r.invariants.values()) for r in passed)
    assert all(r.finished_at >= r.started_at and r.step_attempt_id for r in passed)
    grant = next(r for r in passed if r.gate == "IG_grant_probe")
    assert grant.invariants == {"host_allowed": True, "answered_2xx": True} and grant.details["status"] == 200
    phases = {p.name: p for p in PhaseRecord.objects.filter(run=run)}
    assert len(phases) == 12 and {p.result for p in phases.values()} == {"passed"}
    assert next(r for r in passed if r.gate == "IG_mark").phase == phases["mark"]
    assert phases["mark"].soft_cap_minutes == 5 and phases["lifecycle_enact"].soft_cap_minutes == 15  # seed §6
    # every check ran exactly once: one attempt per gate step
    assert StepAttempt.objects.filter(run=run, step__kind="check").count() == 10
    assert invariants_check() == []


def test_a_broken_invariant_fails_the_run_with_gate_failed_and_names_the_invariant(project, files):
    manifest, _ = files
    plan = small_plan(manifest, middle=check("IG_count", "expect", value=4, equals=5))
    plan["agents"][0]["failure_mode"] = "continue"  # gates fail closed whatever the failure mode
    plan["agents"][0]["tasks"][1]["failure_mode"] = "continue"
    run = drive(start(project, plan, failure_mode="continue"))
    assert (run.status, run.last_error_code) == (Run.Status.FAILED, "gate_failed:IG_count")
    assert "invariant equals broke" in run.last_error
    failed = GateReceipt.objects.get(run=run, gate="IG_count")
    assert (failed.passed, failed.invariants, failed.details) == (False, {"equals": False},
                                                                 {"actual": 4, "expected": 5})
    assert not GateReceipt.objects.filter(run=run, gate__in=["IG_two", "IG_three"]).exists()
    assert run.credits_charged + run.credits_refunded == run.credits_reserved
    assert invariants_check() == []


def test_a_missing_file_breaks_file_digest(project, files):
    manifest, backup = files
    plan = small_plan(manifest, middle=check("IG_backup", "file_digest", path=str(backup), sha256="0" * 64))
    backup.unlink()
    run = drive(start(project, plan))
    assert run.last_error_code == "gate_failed:IG_backup"
    assert GateReceipt.objects.get(run=run, gate="IG_backup").invariants == {"file_readable": False,
                                                                              "sha256_matches": False}


def test_plans_name_registered_checks_with_valid_arguments_and_unique_gates(files, tmp_path):
    manifest, _ = files

    def errors_of(plan):
        with pytest.raises(ValidationFailed) as caught:
            plan_validate(plan)
        return caught.value.errors

    plan = small_plan(manifest, middle=check("IG_x", "file_digest", path="/etc/passwd", sha256="nothex"))
    found = errors_of(plan)
    assert any("must be under one of" in m for m in found["agents[0].tasks[1].steps[0].args"])
    assert any("64 hexadecimal" in m for m in found["agents[0].tasks[1].steps[0].args"])
    plan = small_plan(manifest, middle=check("IG_one", "expect", value=1, equals=1))
    assert "is named twice" in errors_of(plan)["agents[0].tasks[1].steps[0].gate"][0]
    plan = small_plan(manifest, middle=check("IG_x", "expect", equals=1))
    assert errors_of(plan)["agents[0].tasks[1].steps[0].args"] == [
        "give exactly one of value (a value) or pin (a pin's dimension)"]
    plan = small_plan(manifest)
    plan["pins"]["secret"] = {"provider": "setting", "args": {"name": "ORCHESTRATOR_API_TOKEN"}}
    plan["pins"]["nope"] = {"provider": "guess", "args": {}}
    plan["caps"] = {"run_hard_cap_minutes": 0, "phase_soft_cap_minutes": {"phase_one": "soon"}}
    found = errors_of(plan)
    assert found["plan.pins.secret.args"] == ["name: secrets cannot be pinned"]
    assert "unknown pin provider 'guess'" in found["plan.pins.nope.provider"][0]
    assert "plan.caps.run_hard_cap_minutes" in found and "plan.caps.phase_soft_cap_minutes.phase_one" in found
    plan = small_plan(manifest)
    plan["agents"].append({"name": "q", "tasks": [{"name": "phase_one", "steps": [echo("again")]}]})
    assert "unique across agents" in errors_of(plan)["agents[1].tasks[0].name"][0]


# --- pins and drift ------------------------------------------------------------------------------

def test_a_pin_changed_between_gates_stops_the_run_until_acknowledged(project, files, operator, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="orchestrator.transitions")
    manifest, _ = files
    old = sha256(manifest)
    run = drive(start(project, small_plan(manifest)),
                until=lambda r: GateReceipt.objects.filter(run=r, gate="IG_one").exists())
    manifest.write_text("doc ICX-LAW-2026-001 v4\n")  # changes between IG_one and IG_two
    run = drive(run)
    assert (run.status, run.status_reason) == (Run.Status.PAUSED, "stopped_drift:manifest")
    drift = DriftRecord.objects.get(run=run)
    assert (drift.dimension, drift.recorded, drift.live, drift.status, drift.detected_before) == (
        "manifest", old, sha256(manifest), "open", "IG_two")
    assert not GateReceipt.objects.filter(run=run, gate="IG_two").exists()

    with pytest.raises(DriftUnacknowledged):
        services.run_resume(run_id=run.pk, actor=operator, reason="try")
    with pytest.raises(DriftUnacknowledged):
        services.pipeline_resume(run_id=run.pk, actor=operator, reason="try")
    assert Run.objects.get(pk=run.pk).status == Run.Status.PAUSED

    with pytest.raises(ValidationFailed):
        services.drift_acknowledge(run_id=run.pk, actor=operator, reason=" ")
    services.drift_acknowledge(run_id=run.pk, actor=operator, reason="v4 of the manifest is the one we want")
    logged = [r.fields for r in caplog.records if getattr(r, "fields", {}).get("entity") == "drift"]
    assert [(f["drift_id"], f["from"], f["to"], f["dimension"]) for f in logged] == [
        (drift.pk, "open", "acknowledged", "manifest")]
    with pytest.raises(services.DriftNotPending):
        services.drift_acknowledge(run_id=run.pk, actor=operator, reason="again")
    pins = list(ContextPin.objects.filter(run=run, dimension="manifest").order_by("id"))
    assert [(p.value, p.source, p.superseded_at is None) for p in pins] == [(old, "start", False),
                                                                           (sha256(manifest), "acknowledged", True)]
    assert (pins[1].recorded_by, pins[1].reason) == (operator, "v4 of the manifest is the one we want")
    result = services.pipeline_resume(run_id=run.pk, actor=operator, reason="continue")
    assert result.outcome == "resumed"
    revalidated = GateReceipt.objects.get(run=run, kind="revalidation")
    assert (revalidated.gate, revalidated.passed) == ("IG_one", True)
    run = drive(run)
    assert run.status == Run.Status.COMPLETED
    assert [r.gate for r in receipts(run, kind="gate")] == ["IG_one", "IG_two", "IG_three"]
    assert AuditRecord.objects.filter(run_id=run.pk, action="acknowledge_drift").count() == 1


def test_resume_finds_drift_while_stopped_and_stops_again(project, files, operator):
    manifest, _ = files
    run = drive(start(project, small_plan(manifest, middle={"name": "long", "tool": "sleep",
                                                             "args": {"seconds": 0.3}})),
                until=lambda r: GateReceipt.objects.filter(run=r, gate="IG_one").exists())
    services.run_pause(run_id=run.pk, actor=operator, reason="look first")
    run = drive(run)
    manifest.write_text("changed while paused\n")
    result = services.pipeline_resume(run_id=run.pk, actor=operator, reason="go on")
    assert (result.outcome, result.run.status, result.run.status_reason) == (
        "stopped_drift", Run.Status.PAUSED, "stopped_drift:manifest")
    assert DriftRecord.objects.get(run=run).detected_before == "resume"
    services.drift_acknowledge(run_id=run.pk, actor=operator, reason="expected change")
    assert services.pipeline_resume(run_id=run.pk, actor=operator, reason="go on").outcome == "resumed"
    assert drive(run).status == Run.Status.COMPLETED


def test_a_last_passed_gate_that_no_longer_holds_stops_the_resume(project, files, operator):
    manifest, backup = files
    plan = small_plan(manifest, middle={"name": "long", "tool": "sleep", "args": {"seconds": 0.3}})
    plan["agents"][0]["tasks"][0]["steps"] = [check("IG_one", "file_digest", path=str(backup),
                                                    sha256=sha256(backup))]
    run = drive(start(project, plan), until=lambda r: GateReceipt.objects.filter(run=r, gate="IG_one").exists())
    services.run_pause(run_id=run.pk, actor=operator, reason="hold")
    run = drive(run)
    backup.write_bytes(b"tampered")
    result = services.pipeline_resume(run_id=run.pk, actor=operator, reason="go")
    assert (result.outcome, result.run.status_reason) == ("stopped_drift", "stopped_drift:gate:IG_one")
    drift = DriftRecord.objects.get(run=run)
    assert (drift.kind, drift.recorded, drift.live) == ("invariant", {"file_readable": True, "sha256_matches": True},
                                                        {"file_readable": True, "sha256_matches": False})
    services.drift_acknowledge(run_id=run.pk, actor=operator, reason="restored from the second copy")
    assert services.pipeline_resume(run_id=run.pk, actor=operator, reason="go").outcome == "resumed"
    assert drive(run).status == Run.Status.COMPLETED


def test_a_step_replayed_after_its_worker_died_rechecks_pins_and_the_last_gate_first(project, files):
    from jobs.services import job_enqueue
    from runs.models import Step

    manifest, _ = files
    run = services.run_create(project=project, name="gated", plan=small_plan(manifest))
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    one = Step.objects.get(run=run, name="IG_one")
    gates.gate_execute(step=one, attempt=services.step_begin(step_id=one.pk))
    work = Step.objects.get(run=run, name="work")
    interrupted = services.step_begin(step_id=work.pk)  # its worker "dies" here
    manifest.write_text("changed before the replay\n")
    job_enqueue(job_type="run_step", project=project, run_id=run.pk,
                payload={"run": run.pk, "step": work.pk, "round": 0})
    run = drive(run)
    assert (run.status, run.status_reason) == (Run.Status.PAUSED, "stopped_drift:manifest")
    assert DriftRecord.objects.get(run=run).detected_before == "recovery"
    assert StepAttempt.objects.get(pk=interrupted.pk).outcome == "discarded"  # replayed after the acknowledgment
    assert not CommandRecord.objects.filter(idempotency_key=interrupted.idempotency_key).exists()


# --- resume (seed 002 §7) ----------------------------------------------------------------------

def test_resume_leaves_a_completed_run_refuses_a_failed_one_and_changes_nothing_twice(project, files, operator):
    manifest, _ = files
    done = drive(start(project, small_plan(manifest)))
    assert done.status == Run.Status.COMPLETED
    events = Event.objects.filter(run_id=done.pk).count()
    assert services.pipeline_resume(run_id=done.pk, actor=operator, reason="again").outcome == "nothing"
    assert Event.objects.filter(run_id=done.pk).count() == events

    failed = drive(start(project, small_plan(manifest, middle=check("IG_bad", "expect", value=1, equals=2))))
    with pytest.raises(InvalidTransition) as refused:
        services.pipeline_resume(run_id=failed.pk, actor=operator, reason="please")
    assert "retry it (a new attempt) or void it" in refused.value.detail

    paused = drive(start(project, small_plan(manifest, middle={"name": "long", "tool": "sleep",
                                                                "args": {"seconds": 0.3}})),
                   until=lambda r: GateReceipt.objects.filter(run=r, gate="IG_one").exists())
    services.run_pause(run_id=paused.pk, actor=operator, reason="hold")
    first = services.pipeline_resume(run_id=paused.pk, actor=operator, reason="go")
    events = Event.objects.filter(run_id=paused.pk).count()
    audits = AuditRecord.objects.filter(run_id=paused.pk).count()
    second = services.pipeline_resume(run_id=paused.pk, actor=operator, reason="go")
    assert (first.outcome, second.outcome) == ("resumed", "nothing")
    assert Event.objects.filter(run_id=paused.pk).count() == events
    assert AuditRecord.objects.filter(run_id=paused.pk).count() == audits
    assert drive(paused).status == Run.Status.COMPLETED


def test_resuming_a_run_awaiting_approval_needs_a_valid_approval(project, files, operator):
    manifest, _ = files
    plan = small_plan(manifest, middle={"name": "ask", "kind": "approval", "gate": "SG_go"})
    run = drive(start(project, plan))
    assert run.status_reason == "awaiting_approval:SG_go"
    with pytest.raises(services.ApprovalRequired):
        services.pipeline_resume(run_id=run.pk, actor=operator, reason="no approval")
    with pytest.raises(services.ApprovalNotPending):
        services.pipeline_resume(run_id=run.pk, actor=operator, reason="wrong gate", gate="SG_other",
                              approval_ref="KB-1")
    result = services.pipeline_resume(run_id=run.pk, actor=operator, reason="approved", approval_ref="KB-1")
    assert (result.outcome, result.run.status) == ("approved", Run.Status.RESUMING)
    assert services.pipeline_resume(run_id=run.pk, actor=operator, reason="approved",
                                 approval_ref="KB-1").outcome == "nothing"
    assert drive(run).status == Run.Status.COMPLETED
    assert ApprovalRequest.objects.get(run=run).approval_ref == "KB-1"


# --- caps ------------------------------------------------------------------------------------

def test_a_step_overrunning_its_phase_soft_cap_stops_and_escalates(project, files, operator):
    manifest, _ = files
    plan = small_plan(manifest, middle={"name": "slow", "tool": "sleep", "args": {"seconds": 0.5}})
    plan["agents"][0]["tasks"][1]["soft_cap_minutes"] = 0.005  # 0.3 s
    run = drive(start(project, plan))
    assert (run.status, run.status_reason) == (Run.Status.PAUSED, "stop_and_escalate:soft_cap:phase_two")
    ticket = EscalationTicket.objects.get(run=run)
    assert (ticket.trigger, ticket.status) == ("stop_and_escalate", "open")
    assert "phase phase_two" in ticket.detail and "soft cap of 0.005 min" in ticket.detail
    assert PhaseRecord.objects.get(run=run, name="phase_two").cap_escalated_at is not None
    # an operator looks, then lets it go on: the cap does not fire twice
    assert services.pipeline_resume(run_id=run.pk, actor=operator, reason="slow disk, fine").outcome == "resumed"
    assert drive(run).status == Run.Status.COMPLETED
    assert EscalationTicket.objects.filter(run=run).count() == 1


def test_the_hard_cap_counts_running_time_only_and_stops_a_running_run(project, files, operator):
    manifest, _ = files
    plan = small_plan(manifest, middle={"name": "ask", "kind": "approval", "gate": "SG_go"},
                      caps={"run_hard_cap_minutes": 1})
    run = drive(start(project, plan))
    assert run.status_reason == "awaiting_approval:SG_go"
    assert caps_enforce(run_id=run.pk, now=timezone.now() + timedelta(hours=5)) is None  # waiting is not running
    services.approval_grant(run_id=run.pk, gate="SG_go", approval_ref="KB-9", actor=operator, reason="go")
    services.run_mark_running(run_id=run.pk)
    assert caps_enforce(run_id=run.pk, now=timezone.now() + timedelta(seconds=30)) is None
    assert caps_enforce(run_id=run.pk, now=timezone.now() + timedelta(minutes=2)) == "hard_cap"
    run.refresh_from_db()
    assert (run.status, run.status_reason) == (Run.Status.PAUSED, "stop_and_escalate:hard_cap")
    assert EscalationTicket.objects.get(run=run).trigger == "stop_and_escalate"


def test_a_second_cap_while_the_first_caps_ticket_is_open_is_added_to_that_ticket(project, files, operator):
    manifest, _ = files
    plan = small_plan(manifest, middle={"name": "slow", "tool": "sleep", "args": {"seconds": 0.5}},
                      caps={"run_hard_cap_minutes": 1})
    plan["agents"][0]["tasks"][1]["soft_cap_minutes"] = 0.005  # 0.3 s
    run = drive(start(project, plan))
    assert run.status_reason == "stop_and_escalate:soft_cap:phase_two"
    services.pipeline_resume(run_id=run.pk, actor=operator, reason="slow disk, fine")
    services.run_mark_running(run_id=run.pk)
    assert caps_enforce(run_id=run.pk, now=timezone.now() + timedelta(minutes=2)) == "hard_cap"
    assert Run.objects.get(pk=run.pk).status_reason == "stop_and_escalate:hard_cap"
    ticket = EscalationTicket.objects.get(run=run)  # still one ticket, with both caps on it
    assert ticket.status == "open" and "soft cap of 0.005 min" in ticket.detail and "hard cap of 1 min" in ticket.detail
    updated = Event.objects.get(run_id=run.pk, type="escalation_updated")
    assert updated.payload["escalation"] == ticket.pk and "hard cap" in updated.payload["added"]


# --- void, keys, dry runs --------------------------------------------------------------------------

def test_void_cancels_a_stopped_run_releases_its_keys_and_refunds(project, files, operator):
    manifest, _ = files
    plan = small_plan(manifest, middle={"name": "ask", "kind": "approval", "gate": "SG_go"}, key="change-set-42")
    run = drive(start(project, plan))
    assert PipelineKey.objects.get(run=run, phase="phase_two").key == "change-set-42"
    second = services.run_create(project=project, name="same change set", plan=plan)
    with pytest.raises(PipelineKeyInUse):
        services.run_start(run_id=second.pk)
    assert Run.objects.get(pk=second.pk).status == Run.Status.CREATED

    running = drive(start(project, small_plan(manifest, middle={"name": "long", "tool": "sleep",
                                                                 "args": {"seconds": 0.3}})),
                    until=lambda r: r.status == Run.Status.RUNNING)
    with pytest.raises(InvalidTransition):
        services.run_void(run_id=running.pk, actor=operator, reason="not stopped")

    held = run.credits_reserved - run.credits_charged - run.credits_refunded
    assert held > 0
    available = account_balance(organization_id=project.organization_id)["available"]
    voided = services.run_void(run_id=run.pk, actor=operator, reason="wrong document")
    assert (voided.status, voided.status_reason) == (Run.Status.CANCELLED, "voided:wrong document")
    assert voided.credits_charged + voided.credits_refunded == voided.credits_reserved
    assert account_balance(organization_id=project.organization_id)["available"] == available + held
    assert ApprovalRequest.objects.get(run=run).status == ApprovalRequest.Status.VOIDED
    assert not PipelineKey.objects.filter(run=run, released_at__isnull=True).exists()
    assert services.run_void(run_id=run.pk, actor=operator, reason="again").status_reason == "voided:wrong document"
    services.run_start(run_id=second.pk)  # the key is free again
    assert PipelineKey.objects.get(key="change-set-42", released_at__isnull=True).run_id == second.pk
    assert AuditRecord.objects.filter(run_id=run.pk, action="run_void").count() == 1
    drive(running)
    assert invariants_check() == []


def test_the_drift_of_a_voided_run_cannot_be_accepted_any_more(project, files, operator):
    manifest, _ = files
    run = drive(start(project, small_plan(manifest)),
                until=lambda r: GateReceipt.objects.filter(run=r, gate="IG_one").exists())
    manifest.write_text("doc ICX-LAW-2026-001 v5\n")
    run = drive(run)
    assert run.status_reason == "stopped_drift:manifest"
    services.run_void(run_id=run.pk, actor=operator, reason="wrong manifest")
    with pytest.raises(InvalidTransition, match="only a paused run's drift can be accepted"):
        services.drift_acknowledge(run_id=run.pk, actor=operator, reason="too late")
    assert DriftRecord.objects.get(run=run).status == "open"
    assert ContextPin.objects.filter(run=run, source="acknowledged").count() == 0


def test_a_failed_run_can_be_voided(project, files, operator):
    manifest, _ = files
    failed = drive(start(project, small_plan(manifest, middle=check("IG_bad", "expect", value=1, equals=2))))
    voided = services.run_void(run_id=failed.pk, actor=operator, reason="superseded")
    assert (voided.status, voided.status_reason, voided.last_error_code) == (
        Run.Status.CANCELLED, "voided:superseded", "gate_failed:IG_bad")
    assert invariants_check() == []


def test_a_dry_run_executes_checks_but_no_tool(project, files):
    manifest, backup = files
    plan = small_plan(manifest, middle={"name": "ship", "tool": "deploy", "args": {"name": "svc"}})
    run = drive(start(project, plan, mode="dryrun"))
    assert (run.status, run.mode, run.credits_charged) == (Run.Status.COMPLETED, "dryrun", 0)
    assert not CommandRecord.objects.filter(idempotency_key__startswith=f"run:{run.pk}:").exists()
    assert [r.mode for r in receipts(run)] == ["dryrun"] * 3
    assert StepAttempt.objects.get(run=run, step__name="ship").step.output["dryrun"] is True
    live = drive(start(project, plan))  # the same plan, live: the tool runs through the command boundary
    assert (live.status, live.credits_charged) == (Run.Status.COMPLETED, 2)
    assert CommandRecord.objects.filter(idempotency_key__startswith=f"run:{live.pk}:").count() == 1


def test_a_retried_gated_run_pins_its_new_attempt_and_keeps_its_keys(project, files, operator):
    manifest, _ = files
    failed = drive(start(project, small_plan(manifest, middle=check("IG_bad", "expect", value=1, equals=2),
                                             key="CS-9")))
    assert failed.last_error_code == "gate_failed:IG_bad"
    manifest.write_text("fixed manifest\n")
    services.run_retry(run_id=failed.pk, actor=operator, reason="new manifest")
    run = drive(failed)
    assert (run.attempt_number, run.last_error_code) == (2, "gate_failed:IG_bad")
    pins = dict(ContextPin.objects.filter(run=run, dimension="manifest").values_list("attempt_number", "value"))
    assert pins == {1: pins[1], 2: sha256(manifest)} and pins[1] != pins[2]
    assert list(PipelineKey.objects.filter(key="CS-9").values_list("run_id", "released_at")) == [(run.pk, None)]
    assert GateReceipt.objects.filter(run=run, gate="IG_one").count() == 2  # once per attempt
    assert invariants_check() == []


def test_a_gated_run_whose_tool_step_keeps_failing_fails_and_is_never_replanned(project, files):
    manifest, _ = files
    plan = small_plan(manifest, middle={"name": "flaky", "tool": "fail", "args": {"times": 1000}})
    run = drive(start(project, plan))
    assert (run.status, run.last_error_code, run.replan_count) == (Run.Status.FAILED, "drill_retryable", 0)
    assert not Event.objects.filter(run_id=run.pk, type="run_replanned").exists()
    assert [r.gate for r in receipts(run)] == ["IG_one"]  # phase three's gate never ran, with or without its check
    assert invariants_check() == []


def test_a_dry_run_holds_no_phase_key_so_the_live_run_of_the_same_change_set_starts(project, files):
    manifest, _ = files
    plan = small_plan(manifest, key="CS-dry")
    rehearsal = drive(start(project, plan, mode="dryrun"))
    assert rehearsal.status == Run.Status.COMPLETED
    assert not PipelineKey.objects.filter(run=rehearsal).exists()
    live = drive(start(project, plan))
    assert live.status == Run.Status.COMPLETED
    assert list(PipelineKey.objects.filter(key="CS-dry").values_list("run_id", "released_at")) == [(live.pk, None)]
    with pytest.raises(PipelineKeyInUse):  # the live run keeps its key: the change set is applied once
        start(project, plan)
    start(project, plan, mode="dryrun")  # while a rehearsal still may


def test_an_approval_reference_of_an_earlier_attempt_is_refused_and_a_new_one_approves(project, files, operator):
    manifest, backup = files
    plan = small_plan(manifest, middle={"name": "ask", "kind": "approval", "gate": "SG_go"})
    plan["agents"][0]["tasks"][2]["steps"] = [check("IG_three", "file_digest", path=str(backup),
                                                    sha256=sha256(backup))]
    run = drive(start(project, plan))
    services.approval_grant(run_id=run.pk, gate="SG_go", approval_ref="KB-7", actor=operator, reason="go")
    backup.write_bytes(b"tampered")
    assert drive(run).last_error_code == "gate_failed:IG_three"
    backup.write_bytes(b"encrypted backup")
    services.run_retry(run_id=run.pk, actor=operator, reason="backup restored")
    run = drive(run)
    assert (run.attempt_number, run.status_reason) == (2, "awaiting_approval:SG_go")
    with pytest.raises(services.ApprovalReused) as refused:
        services.approval_grant(run_id=run.pk, gate="SG_go", approval_ref="KB-7", actor=operator, reason="again")
    assert refused.value.extra["attempt"] == 1
    assert Run.objects.get(pk=run.pk).status == Run.Status.PAUSED
    request = services.approval_grant(run_id=run.pk, gate="SG_go", approval_ref="KB-8", actor=operator, reason="go")
    assert (request.attempt_number, request.approval_ref) == (2, "KB-8")
    assert drive(run).status == Run.Status.COMPLETED
    assert invariants_check() == []


def test_approvals_log_their_transitions_and_a_cancel_voids_a_pending_approval(
        project, files, operator, caplog):
    import json
    import logging

    from core.logging import JsonFormatter

    caplog.set_level(logging.INFO, logger="orchestrator.transitions")
    manifest, _ = files
    plan = small_plan(manifest, middle={"name": "ask", "kind": "approval", "gate": "SG_go"})
    approved = drive(start(project, plan))
    services.approval_grant(run_id=approved.pk, gate="SG_go", approval_ref="KB-log", actor=operator, reason="go")
    drifted = drive(start(project, plan))
    services.run_cancel(run_id=drifted.pk, actor=operator, reason="wrong manifest")
    cancelled = Run.objects.get(pk=drifted.pk)
    assert (cancelled.status, cancelled.status_reason) == (Run.Status.CANCELLED, "")
    assert ApprovalRequest.objects.get(run=cancelled).status == ApprovalRequest.Status.VOIDED

    lines = [json.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == "orchestrator.transitions"]
    approvals = [(line["run_id"], line["from"], line["to"], line["reason"]) for line in lines
                 if line["entity"] == "approval"]
    assert approvals == [(approved.pk, "pending", "approved", "go"), (drifted.pk, "pending", "voided", "wrong manifest")]
    assert {line["entity"] for line in lines} >= {"run", "agent", "task", "step", "approval"}
