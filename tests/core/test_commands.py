"""The runbook commands: top-ups, the invariant check and the demo seed (onboarding and
``run_console`` are tested under tests/console/).

Commands parse arguments and call one service; a domain error becomes a ``CommandError``
with a readable message, never a traceback.
"""

from __future__ import annotations

import json
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError, connection, transaction

from billing.models import LedgerEntry
from billing.selectors import account_balance
from core.models import AuditRecord, Membership, Organization, Project
from jobs.models import QueuePause
from runs import services
from runs.invariants import invariants_check
from runs.models import Run
from tests.conftest import make_plan
from tests.ledger_guard import ledger_triggers_lifted


def run_command(name: str, *args: str) -> str:
    out = StringIO()
    call_command(name, *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def run_json(name: str, *args: str) -> dict:
    return json.loads(run_command(name, *args))


# --- topup_credits --------------------------------------------------------------------------

@pytest.fixture
def acme(db):
    data = run_json("create_organization", "Acme", "--owner", "alice", "--credits", "100")
    return Organization.objects.get(pk=data["organization"])


def test_topup_by_name_and_by_id(acme):
    by_name = run_json("topup_credits", "Acme", "--amount", "250", "--reason", "invoice 41")
    assert (by_name["created"], by_name["balance"], by_name["available"]) == (True, 350, 350)
    by_id = run_json("topup_credits", str(acme.pk), "--amount", "50", "--reason", "invoice 42")
    assert (by_id["created"], by_id["balance"], by_id["organization"]) == (True, 400, acme.pk)
    entries = list(LedgerEntry.objects.filter(organization=acme).values_list("kind", "amount", "reason"))
    assert entries == [("topup", 100, "initial credits"), ("topup", 250, "invoice 41"), ("topup", 50, "invoice 42")]
    assert LedgerEntry.objects.get(pk=by_id["entry"]).amount == 50
    assert invariants_check() == []


def test_topup_with_the_same_key_adds_credits_once(acme):
    first = run_json("topup_credits", "Acme", "--amount", "70", "--reason", "wire", "--key", "wire-2024-001")
    again = run_json("topup_credits", "Acme", "--amount", "70", "--reason", "wire", "--key", "wire-2024-001")
    assert (first["created"], again["created"]) == (True, False)
    assert first["entry"] == again["entry"]
    assert again["balance"] == 170
    assert LedgerEntry.objects.filter(organization=acme, idempotency_key="wire-2024-001").count() == 1


def test_topup_records_the_operator_it_runs_as(acme, django_user_model):
    operator = django_user_model.objects.create_user(username="ops", is_staff=True)
    data = run_json("topup_credits", "Acme", "--amount", "5", "--reason", "goodwill", "--as", "ops")
    entry = LedgerEntry.objects.get(pk=data["entry"])
    assert (entry.actor_id, entry.actor_label, entry.reason) == (operator.pk, "ops", "goodwill")
    record = AuditRecord.objects.filter(action="credits_topup").latest("id")
    assert (record.actor_id, record.before, record.after) == (operator.pk, {"balance": 100}, {"balance": 105})


@pytest.mark.parametrize(("args", "message"), [
    (["Acme", "--amount", "0", "--reason", "r"], "validation_error: amount must be positive"),
    (["Acme", "--amount=-5", "--reason", "r"], "validation_error: amount must be positive"),
    (["Acme", "--amount", "ten", "--reason", "r"], "invalid int value: 'ten'"),
    (["Acme", "--amount", "5", "--reason", "  "], "validation_error: a reason is required"),
    (["Nobody Inc", "--amount", "5", "--reason", "r"], "not_found: organization 'Nobody Inc' does not exist"),
    (["999999", "--amount", "5", "--reason", "r"], "not_found: organization '999999' does not exist"),
    (["Acme", "--amount", "5", "--reason", "r", "--as", "ghost"], "user 'ghost' does not exist"),
])
def test_topup_refuses_bad_input(acme, args, message):
    with pytest.raises(CommandError) as raised:
        run_command("topup_credits", *args)
    assert message in str(raised.value)
    assert account_balance(organization_id=acme.pk)["balance"] == 100
    assert LedgerEntry.objects.count() == 1


# --- check_invariants -----------------------------------------------------------------------

@pytest.fixture
def busy_org(org_factory):
    """An organization with a completed run and a cancelled one: plenty of ledger rows."""
    organization, project, _ = org_factory(credits=100)
    done = services.run_create(project=project, name="done", plan=make_plan(steps=2))
    services.run_start(run_id=done.pk)
    services.run_mark_running(run_id=done.pk)
    for _ in range(2):
        step = services.runnable_steps(Run.objects.get(pk=done.pk))[0]
        attempt = services.step_begin(step_id=step.pk)
        services.step_attempt_succeed(attempt_id=attempt.pk)
    stopped = services.run_create(project=project, name="stopped", plan=make_plan())
    services.run_start(run_id=stopped.pk)
    services.run_cancel(run_id=stopped.pk)
    assert Run.objects.get(pk=done.pk).status == Run.Status.COMPLETED
    return organization


def test_check_invariants_exits_zero_on_a_healthy_database(busy_org):
    assert "all invariants hold" in run_command("check_invariants")
    assert json.loads(run_command("check_invariants", "--json")) == {"ok": True, "violations": []}


def test_check_invariants_exits_one_and_names_a_tampered_ledger_row(busy_org):
    entry = LedgerEntry.objects.filter(organization=busy_org, kind="charge").first()
    # The triggers refuse the UPDATE: lift them as someone owning the database could.
    with ledger_triggers_lifted(connection), connection.cursor() as cursor:
        cursor.execute("UPDATE billing_ledgerentry SET amount = amount + 5 WHERE id = %s", [entry.pk])

    out = StringIO()
    with pytest.raises(SystemExit) as raised:
        call_command("check_invariants", stdout=out)

    assert raised.value.code == 1
    lines = out.getvalue().splitlines()
    assert f"[ledger] entry {entry.pk}: content changed after it was written" in lines
    assert any(line.startswith(f"[credits] run {entry.run_id} attempt 1") for line in lines)
    assert any(line.startswith(f"[credits] organization {busy_org.pk}: account balance") for line in lines)
    assert lines[-1].endswith("violation(s)")


def test_the_database_refuses_to_update_or_delete_a_ledger_row(busy_org):
    entry = LedgerEntry.objects.filter(organization=busy_org).first()
    for statement in ("UPDATE billing_ledgerentry SET amount = amount + 5 WHERE id = %s",
                      "DELETE FROM billing_ledgerentry WHERE id = %s"):
        with pytest.raises(DatabaseError, match="append-only"):
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(statement, [entry.pk])
    assert LedgerEntry.objects.get(pk=entry.pk).amount == entry.amount
    assert "all invariants hold" in run_command("check_invariants")


def test_check_invariants_exits_one_and_names_a_tampered_account(busy_org):
    with connection.cursor() as cursor:
        cursor.execute("UPDATE billing_creditaccount SET balance = balance + 7 WHERE organization_id = %s",
                       [busy_org.pk])

    out = StringIO()
    with pytest.raises(SystemExit) as raised:
        call_command("check_invariants", "--json", stdout=out)

    assert raised.value.code == 1
    result = json.loads(out.getvalue())
    assert result["ok"] is False
    assert result["violations"] == [{
        "check": "credits",
        "message": f"organization {busy_org.pk}: account balance 105/reserved 0 differ from the ledger 98/0",
    }]
    # --only restricts the checks: the ledger chain itself is intact.
    assert "all invariants hold" in run_command("check_invariants", "--only", "ledger")


# --- seed_demo ------------------------------------------------------------------------------

@pytest.mark.django_db
def test_seed_demo_is_idempotent(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast, for tests only
    first = run_json("seed_demo", "--password", "demo-pass")

    def snapshot():
        return {
            "organizations": list(Organization.objects.values_list("pk", "name")),
            "projects": list(Project.objects.values_list("pk", "name")),
            "runs": list(Run.objects.values_list("pk", "name", "status")),
            "ledger": list(LedgerEntry.objects.values_list("pk", flat=True)),
            "members": list(Membership.objects.values_list("organization_id", "user_id", "role")),
            "users": list(get_user_model().objects.values_list("pk", "username")),
        }

    seeded = snapshot()
    second = run_json("seed_demo", "--password", "demo-pass")

    assert first["created"] and second["created"] == []  # the second time, nothing new
    assert first == {"organization": first["organization"], "username": "operator", "password": "demo-pass",
                     "created": first["created"]}
    assert second == {"organization": first["organization"], "username": "operator", "password": None,
                      "created": [], "note": "user 'operator' already existed: its password, staff status and "
                                             "groups were left as they are"}
    assert snapshot() == seeded
    organization = Organization.objects.get(pk=first["organization"])
    assert organization.name == "Demo Org"
    # the third project shows a paused queue (once: seeding again neither pauses nor resumes it)
    assert sorted(p.name for p in organization.projects.all()) == ["default", "nightly", "research"]
    assert list(QueuePause.objects.values_list("project__name", flat=True)) == ["nightly"]
    assert Run.objects.filter(project__organization=organization, status=Run.Status.CREATED).count() == 3
    user = get_user_model().objects.get(username="operator")
    assert user.is_staff and user.is_superuser and user.check_password("demo-pass")
    assert account_balance(organization_id=organization.pk)["balance"] == 100_000
    assert list(LedgerEntry.objects.filter(organization=organization).values_list("kind", "amount")) == [
        ("topup", 100_000)]  # the initial credits only, no second "demo top-up"
    assert invariants_check() == []


@pytest.mark.django_db
def test_seed_demo_leaves_an_existing_user_as_it_is(settings):
    from django.contrib.auth.models import Group

    user = get_user_model().objects.create_user(username="operator", password="their-own-password")
    user.groups.add(Group.objects.create(name="readers"))
    result = run_json("seed_demo", "--password", "operator")
    user.refresh_from_db()
    assert (user.is_staff, user.is_superuser) == (False, False)
    assert user.check_password("their-own-password") and not user.check_password("operator")
    assert list(user.groups.values_list("name", flat=True)) == ["readers"]
    assert result["password"] is None and "already existed" in result["note"]
    assert not any("user" in line for line in result["created"])
    assert Organization.objects.filter(name="Demo Org").exists()  # the rest of the demo is seeded


# --- every runbook has a test ---------------------------------------------------------------

def test_every_management_command_is_exercised_by_a_test():
    root = Path(settings.BASE_DIR)
    commands = sorted(path.stem for app in ("core", "billing", "jobs", "runs", "diagnosis", "console")
                      for path in (root / app / "management" / "commands").glob("*.py")
                      if not path.stem.startswith("_"))
    assert {"create_organization", "topup_credits", "check_invariants", "seed_demo", "queue_status"} <= set(commands)
    tests = "\n".join(path.read_text() for path in (root / "tests").rglob("test_*.py"))
    untested = [name for name in commands if f'"{name}"' not in tests]
    assert untested == []
