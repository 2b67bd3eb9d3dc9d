"""Out-of-range arguments end every command with a clear ``CommandError`` (never an overflow
traceback), and a named ``--as`` user needs the runbook's permission, as in the admin."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.auth.models import Group
from django.core.management import call_command
from django.core.management.base import CommandError

from core.models import AuditRecord
from runs.models import Run

pytestmark = pytest.mark.django_db

HUGE = "99999999999999999999999"


def run_command(name: str, *args: str) -> str:
    out = StringIO()
    call_command(name, *args, stdout=out, stderr=StringIO())
    return out.getvalue()


@pytest.mark.parametrize("argv, message", [
    (["force_fail_run", HUGE, "--reason", "x"], "is not an id"),
    (["cancel_run", "-5", "--reason", "x"], "is not an id"),
    (["requeue_job", HUGE, "--reason", "x"], "is not an id"),
    (["fail_job", HUGE, "--reason", "x"], "is not an id"),
    (["cancel_job", HUGE, "--reason", "x"], "is not an id"),
    (["export_run", HUGE], "is not an id"),
    (["recover_stuck_runs", "--reason", "x", "--older-than", f"{HUGE}d"], "--older-than"),
    (["recover_stuck_runs", "--reason", "x", "--older-than", "9999999d"], "at most 3650d"),
    (["recover_stuck_runs", "--reason", "x", "--limit", HUGE], "out of range"),
    (["recover_stuck_runs", "--reason", "x", "--limit", "0"], "out of range"),
    (["queue_status", "--limit", HUGE], "out of range"),
    (["queue_status", "--limit", "ten"], "is not a whole number"),
    (["set_retention", "{project}", "--days", HUGE, "--reason", "x"], "days"),
    (["topup_credits", "{org}", "--amount", HUGE, "--reason", "x"], "amount"),
    (["refund_run", "{run}", "--amount", HUGE, "--reason", "x"], "amount"),
    (["create_organization", "huge", "--owner", "huge", "--credits", HUGE], "out of range"),
    (["prune", "--batch", HUGE], "out of range"),
    (["prune", "--max-seconds", "1e400"], "out of range"),
    (["prune", "--max-seconds", "nan"], "out of range"),
])
def test_out_of_range_arguments_are_command_errors(argv, message, project, run_in):
    run = run_in("completed")
    before = Run.objects.filter(pk=run.pk).values().get()
    names = {"project": project.pk, "org": project.organization_id, "run": run.pk}
    argv = [arg.format(**names) for arg in argv]
    with pytest.raises(CommandError, match=message):
        run_command(*argv)
    assert Run.objects.filter(pk=run.pk).values().get() == before


def test_an_as_user_without_the_runbook_permission_is_refused(run_in, make_staff):
    run = run_in("running")
    make_staff("viewer")
    with pytest.raises(CommandError, match="user 'viewer' lacks the permission 'runs.cancel_run': cannot cancel"):
        run_command("cancel_run", str(run.pk), "--reason", "x", "--as", "viewer")
    inactive = make_staff("gone", group="Operators")
    inactive.is_active = False
    inactive.save()
    with pytest.raises(CommandError, match="user 'gone' is inactive"):
        run_command("cancel_run", str(run.pk), "--reason", "x", "--as", "gone")
    assert Run.objects.get(pk=run.pk).status == Run.Status.RUNNING
    assert not AuditRecord.objects.filter(action="run_cancel").exists()

    operator = make_staff("on-call", group="Operators")
    assert run_command("cancel_run", str(run.pk), "--reason", "x", "--as", "on-call").startswith(f"run {run.pk}: done")
    assert AuditRecord.objects.get(action="run_cancel").actor_id == operator.pk
    assert Group.objects.get(name="Operators").permissions.filter(codename="cancel_run").exists()
