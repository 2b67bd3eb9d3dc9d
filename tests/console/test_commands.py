"""The runbooks from the shell: the same runbooks as the admin actions, with ``--reason``,
``--dry-run``, ``--as`` and ``--json``; bad arguments end with a clear ``CommandError``."""

from __future__ import annotations

import getpass
import json
from dataclasses import dataclass, field
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from core.models import AuditRecord
from jobs.models import Job
from jobs.worker import beat
from runs.invariants import invariants_check
from runs.models import EscalationTicket, Run

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(operator):
    """The shared ``op`` user, in the Operators group: a named ``--as`` user needs the runbook's permission."""
    from django.contrib.auth.models import Group

    operator.groups.add(Group.objects.get(name="Operators"))
    return operator


def run_command(name: str, *args: str) -> str:
    out = StringIO()
    call_command(name, *args, stdout=out, stderr=StringIO())
    return out.getvalue()


@dataclass(frozen=True)
class Case:
    start: str
    end: str
    audit: str
    args: list = field(default_factory=list)
    repeat: str = ""


RUN_COMMANDS = {
    "start_run": Case("created", "pending", "run_start", repeat="already started (pending)"),
    "force_fail_run": Case("running", "failed", "run_force_fail", repeat="already failed"),
    "cancel_run": Case("paused", "cancelled", "run_cancel", repeat="already cancelled"),
    "pause_run": Case("running", "paused", "run_pause", repeat="already paused"),
    "resume_run": Case("paused", "resuming", "run_resume", repeat="already resuming"),
    "retry_run": Case("failed", "retrying", "run_retry", repeat="already retrying"),
    "refund_run": Case("completed", "completed", "run_refund", args=["--amount", "1", "--key", "T-1"],
                       repeat="already refunded under this idempotency key"),
    "escalate_run": Case("running", "running", "run_escalate", args=["--severity", "critical"],
                         repeat="already escalated"),
    "approve_gate": Case("awaiting_approval", "resuming", "approve_gate", args=["--gate", "publish", "--ref", "CHG-9"],
                         repeat="already approved"),
}


def shell_label() -> str:
    try:
        return f"shell:{getpass.getuser()}"
    except Exception:
        return "shell:unknown"


@pytest.mark.parametrize("command", list(RUN_COMMANDS))
def test_run_command_dry_run_then_run_then_repeat(run_in, command):
    case = RUN_COMMANDS[command]
    run = run_in(case.start)
    before = Run.objects.filter(pk=run.pk).values().get()

    planned = run_command(command, str(run.pk), "--reason", "incident 7", "--dry-run", *case.args)
    assert planned.startswith(f"dry run: run {run.pk}: would do: "), planned
    assert Run.objects.filter(pk=run.pk).values().get() == before
    assert not AuditRecord.objects.filter(action=case.audit).exists()

    done = run_command(command, str(run.pk), "--reason", "incident 7", *case.args)
    assert done.startswith(f"run {run.pk}: done: "), done
    assert Run.objects.get(pk=run.pk).status == case.end
    audit = AuditRecord.objects.get(action=case.audit, run_id=run.pk)
    assert (audit.actor_id, audit.actor_label, audit.reason) == (None, shell_label(), "incident 7")

    again = run_command(command, str(run.pk), "--reason", "incident 7", *case.args)
    assert again.startswith(f"run {run.pk}: skipped: ") and case.repeat in again, again
    assert AuditRecord.objects.filter(action=case.audit, run_id=run.pk).count() == 1
    assert invariants_check() == []


@pytest.mark.parametrize("command", list(RUN_COMMANDS))
def test_run_command_requires_a_reason_and_names_bad_arguments(run_in, command):
    case = RUN_COMMANDS[command]
    run = run_in(case.start)
    with pytest.raises(CommandError, match="the following arguments are required: --reason"):
        run_command(command, str(run.pk), *case.args)
    with pytest.raises(CommandError, match="--reason must not be empty"):
        run_command(command, str(run.pk), "--reason", "  ", *case.args)
    with pytest.raises(CommandError, match="'abc' is not an id"):
        run_command(command, "abc", "--reason", "x", *case.args)
    with pytest.raises(CommandError, match="run 999999 does not exist"):
        run_command(command, "999999", "--reason", "x", *case.args)
    with pytest.raises(CommandError, match="user 'ghost' does not exist"):
        run_command(command, str(run.pk), "--reason", "x", "--as", "ghost", *case.args)
    assert Run.objects.get(pk=run.pk).status == run.status
    assert not AuditRecord.objects.filter(action=case.audit).exists()


def test_as_names_the_audit_actor_and_json_reports_each_run(run_in, operator):
    running, completed, paused = run_in("running"), run_in("completed"), run_in("paused")
    with pytest.raises(CommandError) as raised:
        run_command("force_fail_run", str(running.pk), str(completed.pk), str(paused.pk), "--reason", "bad deploy",
                    "--as", "op", "--json")
    assert str(raised.value).startswith(f"1 of 3 runs refused: {paused.pk}: invalid_transition: run {paused.pk} is "
                                        "paused; cannot fail")
    assert AuditRecord.objects.get(action="run_force_fail").actor_id == operator.pk
    assert Run.objects.get(pk=running.pk).status == "failed"
    out = StringIO()
    call_command("force_fail_run", str(running.pk), str(completed.pk), "--reason", "again", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert data["results"] == [
        {"run": running.pk, "result": "skipped", "detail": "already failed"},
        {"run": completed.pk, "result": "skipped", "detail": "already ended (completed)"},
    ]
    assert (data["action"], data["done"], data["skipped"], data["refused"]) == ("force_fail", 0, 2, 0)


def test_a_single_refused_run_is_a_command_error_naming_why(run_in):
    created = run_in("created")
    with pytest.raises(CommandError, match=f"run {created.pk}: invalid_transition: run {created.pk} is created; "
                                           "cannot resume"):
        run_command("resume_run", str(created.pk), "--reason", "x")
    completed = run_in("completed")
    with pytest.raises(CommandError, match="cannot refund 5: only 3 charged"):
        run_command("refund_run", str(completed.pk), "--reason", "x", "--amount", "5")
    with pytest.raises(CommandError, match="--amount must be a whole number greater than zero"):
        run_command("refund_run", str(completed.pk), "--reason", "x", "--amount", "0")
    assert "refunded 3 credits (0 still charged)" in run_command("refund_run", str(completed.pk), "--reason", "x")
    with pytest.raises(CommandError, match="the following arguments are required: --gate, --ref"):
        run_command("approve_gate", str(completed.pk), "--reason", "x")
    failed = run_in("failed", max_attempts=1)
    with pytest.raises(CommandError, match=r"attempts exhausted \(1 of 1\)"):
        run_command("retry_run", str(failed.pk), "--reason", "x")
    assert invariants_check() == []


def test_escalate_run_opens_one_manual_ticket(run_in):
    run = run_in("running")
    run_command("escalate_run", str(run.pk), "--reason", "customer call", "--severity", "critical")
    ticket = EscalationTicket.objects.get(run=run)
    assert (ticket.trigger, ticket.severity, ticket.detail, ticket.status) == ("manual", "critical", "customer call",
                                                                               "open")


def test_recover_stuck_runs(run_in):
    running, paused, pending = run_in("running"), run_in("paused"), run_in("pending")
    held = running.credits_reserved - running.credits_charged - running.credits_refunded
    assert run_command("recover_stuck_runs", "--reason", "worker died").strip() == "nothing to do"
    planned = run_command("recover_stuck_runs", "--reason", "worker died", "--older-than", "0s", "--dry-run")
    assert planned.startswith(f"dry run: run {running.pk}: would do: agents terminated; running → failed "
                              f"(heartbeat_timeout); releases {held} unused reserved credits")
    data = json.loads(run_command("recover_stuck_runs", "--reason", "worker died", "--older-than", "0", "--json"))
    assert data["results"] == [{"run": running.pk, "result": "done",
                                "detail": f"running → failed (heartbeat_timeout); {held} credits released"}]
    recovered = Run.objects.get(pk=running.pk)
    assert (recovered.status, recovered.last_error_code, recovered.credits_refunded) == ("failed", "heartbeat_timeout",
                                                                                         held)
    assert not recovered.agents.filter(status__in=["pending", "running", "paused"]).exists()
    assert {Run.objects.get(pk=paused.pk).status, Run.objects.get(pk=pending.pk).status} == {"paused", "pending"}
    assert AuditRecord.objects.get(run_id=running.pk, action="run_recover").reason == "worker died"
    assert run_command("recover_stuck_runs", "--reason", "again", "--older-than", "0").strip() == "nothing to do"
    for bad, message in ((["--older-than", "5 weeks"], "give a duration such as 90, 90s, 5m, 2h or 1d"),
                         (["--limit", "0"], "'0' is out of range: give 1 to 1,000,000"),
                         ([], "the following arguments are required: --reason")):
        with pytest.raises(CommandError, match=message):
            run_command("recover_stuck_runs", *(["--reason", "x"] if bad else []), *bad)
    assert invariants_check() == []


# --- escalation tickets -----------------------------------------------------------------------

def test_acknowledge_and_resolve_escalation(escalation, operator):
    ticket = escalation()
    planned = run_command("acknowledge_escalation", str(ticket.pk), "--reason", "looking", "--dry-run")
    assert planned.startswith(f"dry run: ticket {ticket.pk}: would do: open → acknowledged"), planned
    assert EscalationTicket.objects.get(pk=ticket.pk).status == "open"
    data = json.loads(run_command("acknowledge_escalation", str(ticket.pk), "--reason", "looking", "--as", "op",
                                  "--json"))
    assert data["results"] == [{"ticket": ticket.pk, "result": "done", "detail": "open → acknowledged"}]
    assert "skipped: already acknowledged" in run_command("acknowledge_escalation", str(ticket.pk), "--reason", "x")
    assert run_command("resolve_escalation", str(ticket.pk), "--reason", "restarted the worker").startswith(
        f"ticket {ticket.pk}: done: acknowledged → resolved")
    ticket = EscalationTicket.objects.get(pk=ticket.pk)
    assert (ticket.status, ticket.resolution, ticket.acknowledged_by_id) == ("resolved", "restarted the worker",
                                                                             operator.pk)
    assert "skipped: already resolved" in run_command("resolve_escalation", str(ticket.pk), "--reason", "again")
    with pytest.raises(CommandError, match="ticket 424242 does not exist"):
        run_command("resolve_escalation", "424242", "--reason", "x")
    assert list(AuditRecord.objects.filter(target_type="escalation").order_by("id").values_list("action", flat=True)) \
        == ["escalation_acknowledge", "escalation_resolve"]


# --- jobs -------------------------------------------------------------------------------------

def test_requeue_fail_and_cancel_job(job_in, operator):
    executing, queued = job_in("executing"), job_in("queued")
    assert "would do" in run_command("requeue_job", str(executing.pk), "--reason", "wedged", "--dry-run")
    assert Job.objects.get(pk=executing.pk).state == "executing"
    out = run_command("requeue_job", str(executing.pk), str(queued.pk), "--reason", "wedged", "--as", "op")
    assert out.splitlines() == [f"job {executing.pk}: done: executing → awaiting_tool",
                                f"job {queued.pk}: skipped: already waiting (queued)", "1 done, 1 skipped"]
    assert run_command("fail_job", str(executing.pk), "--reason", "poison").startswith(
        f"job {executing.pk}: done: awaiting_tool → failed")
    assert "skipped: already ended (failed)" in run_command("fail_job", str(executing.pk), "--reason", "poison")
    assert run_command("cancel_job", str(queued.pk), "--reason", "not needed").startswith(
        f"job {queued.pk}: done: queued → cancelled")
    assert run_command("cancel_job", str(queued.pk), "--reason", "not needed").startswith(
        f"job {queued.pk}: skipped: already cancelled")  # twice: nothing more happens
    with pytest.raises(CommandError, match="job 424242 does not exist"):
        run_command("cancel_job", "424242", "--reason", "x")
    with pytest.raises(CommandError, match="the following arguments are required: --reason"):
        run_command("fail_job", str(queued.pk))
    assert list(AuditRecord.objects.filter(target_type="job").order_by("id").values_list("action", "actor_label")) == [
        ("job_requeue", "op"), ("job_fail", shell_label()), ("job_cancel", shell_label())]


def test_queue_status_table_and_json(job_in, monkeypatch):
    executing = job_in("executing")
    job_in("queued")
    monkeypatch.setattr("jobs.worker.close_old_connections", lambda: None)  # keep the test's connection
    beat()  # this process, seen as a worker
    table = run_command("queue_status")
    for text in ("1 waiting, 1 executing of 2 slots", "Depth by lane and type", "console_probe", "Executing jobs",
                 "Workers seen", "console-test"):
        assert text in table, text
    data = json.loads(run_command("queue_status", "--json"))
    assert (data["waiting"], data["executing"]) == (1, 1)
    assert data["lanes"] == [{"lane": "", "type": "console_probe", "waiting": 1, "executing": 1,
                              "oldest_waiting_s": data["lanes"][0]["oldest_waiting_s"]}]
    assert [job["id"] for job in data["executing_jobs"]] == [executing.pk]
    assert data["executing_jobs"][0]["age_s"] >= 0 and data["executing_jobs"][0]["worker"] == "console-test"
    assert len(data["workers"]) == 1 and data["workers"][0]["alive"] is True
    with pytest.raises(CommandError, match="'0' is out of range: give 1 to 100,000"):
        run_command("queue_status", "--limit", "0")
