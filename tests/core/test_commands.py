"""The runbook commands: onboarding, top-ups, the invariant check and the demo seed.

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

from billing.models import CreditAccount, LedgerEntry
from billing.selectors import account_balance
from core.models import AuditRecord, Membership, Organization, Project
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


# --- create_organization --------------------------------------------------------------------

@pytest.mark.django_db
def test_create_organization_creates_owner_project_and_account_and_prints_ids():
    data = run_json("create_organization", "Acme", "--owner", "alice", "--credits", "500")

    organization = Organization.objects.get(name="Acme")
    project = Project.objects.get(organization=organization)
    owner = get_user_model().objects.get(username="alice")
    assert data == {"organization": organization.pk, "project": project.pk, "owner": owner.pk,
                    "owner_username": "alice", "owner_created": True, "credits": 500}
    assert project.name == "default"
    assert Membership.objects.get(organization=organization, user=owner).role == Membership.Role.OWNER
    assert not owner.has_usable_password() and not owner.is_staff
    assert account_balance(organization_id=organization.pk) == {
        "organization": organization.pk, "balance": 500, "reserved": 0, "available": 500}
    entry = LedgerEntry.objects.get(organization=organization)
    assert (entry.kind, entry.amount, entry.run_id) == ("topup", 500, None)
    assert invariants_check() == []


@pytest.mark.django_db
def test_create_organization_without_credits_opens_an_empty_account_for_an_existing_user():
    owner = get_user_model().objects.create_user(username="bob")
    data = run_json("create_organization", "Bobs", "--owner", "bob", "--staff")
    assert (data["owner"], data["owner_created"], data["credits"]) == (owner.pk, False, 0)
    owner.refresh_from_db()
    assert owner.is_staff
    account = CreditAccount.objects.get(organization_id=data["organization"])
    assert (account.balance, account.reserved) == (0, 0)
    assert not LedgerEntry.objects.filter(organization_id=data["organization"]).exists()


@pytest.mark.django_db
def test_create_organization_refuses_a_duplicate_name_with_a_clear_message():
    run_command("create_organization", "Acme", "--owner", "alice", "--credits", "10")
    with pytest.raises(CommandError) as raised:
        run_command("create_organization", "Acme", "--owner", "carol", "--credits", "10")
    assert str(raised.value) == "validation_error: invalid organization (name: organization 'Acme' already exists)"
    assert Organization.objects.filter(name="Acme").count() == 1
    assert not get_user_model().objects.filter(username="carol").exists()
    assert LedgerEntry.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(("args", "message"), [
    (["Neg", "--owner", "dave", "--credits=-5"], "--credits: '-5' is out of range"),
    (["  ", "--owner", "dave"], "name: must not be empty"),
    (["Blank", "--owner", " "], "owner: must not be empty"),
    (["NoOwner"], "the following arguments are required: --owner"),
])
def test_create_organization_refuses_bad_input(args, message):
    with pytest.raises(CommandError, match=message):
        run_command("create_organization", *args)
    assert not Organization.objects.exists()
    assert not get_user_model().objects.filter(username="dave").exists()


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
    assert sorted(p.name for p in organization.projects.all()) == ["default", "research"]
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


# --- run_console (no real processes: children, signals and sleep are faked) --------------------

class FakeChild:
    """A child process that exits with ``code`` after ``polls`` polls (never, when ``polls`` is None)."""

    def __init__(self, args: list[str], polls: int | None, code: int) -> None:
        self.args, self.pid, self.returncode, self.signals = args, 0, None, []
        self._polls_left, self._code = polls, code

    def poll(self):
        if self.returncode is None and self._polls_left is not None:
            self._polls_left -= 1
            if self._polls_left < 0:
                self.returncode = self._code
        return self.returncode

    def send_signal(self, signum) -> None:
        self.signals.append(signum)
        self.returncode = -signum

    def wait(self, timeout=None):
        return self.returncode


@pytest.fixture
def console(monkeypatch):
    import signal as real_signal
    import subprocess as real_subprocess
    import time as real_time
    from types import SimpleNamespace

    from console.management.commands import run_console

    state = {"children": {}, "exits": {}, "handlers": {}, "on_sleep": lambda: None}

    def popen(args, **kwargs):
        name = next((n for n in ("qcluster", "demo_stream") if n in args), "daphne")
        polls, code = state["exits"].get(name, (None, 0))
        state["children"][name] = FakeChild(args, polls, code)
        return state["children"][name]

    monkeypatch.setattr(run_console, "subprocess", SimpleNamespace(
        Popen=popen, TimeoutExpired=real_subprocess.TimeoutExpired))
    monkeypatch.setattr(run_console, "signal", SimpleNamespace(
        signal=lambda signum, handler: state["handlers"].__setitem__(signum, handler),
        SIGINT=real_signal.SIGINT, SIGTERM=real_signal.SIGTERM, SIGKILL=real_signal.SIGKILL))
    monkeypatch.setattr(run_console, "time", SimpleNamespace(
        sleep=lambda seconds: state["on_sleep"](), monotonic=real_time.monotonic))
    monkeypatch.setattr(run_console.os, "killpg", lambda pid, signum: pytest.fail("nothing should need SIGKILL"))
    return state


@pytest.mark.django_db
def test_run_console_stops_both_children_on_ctrl_c(console):
    import signal

    console["on_sleep"] = lambda: console["handlers"][signal.SIGINT](signal.SIGINT, None)
    out = StringIO()
    call_command("run_console", "--host", "0.0.0.0", "--port", "9000", stdout=out, stderr=StringIO())

    daphne, cluster = console["children"]["daphne"], console["children"]["qcluster"]
    assert daphne.args[1:] == ["-m", "daphne", "-b", "0.0.0.0", "-p", "9000", "orchestrator_site.asgi:application"]
    assert cluster.args[-1] == "qcluster"
    assert daphne.signals == cluster.signals == [signal.SIGTERM]
    assert "http://0.0.0.0:9000/admin/ (daphne, qcluster)" in out.getvalue()
    assert "demo_stream" not in console["children"]
    assert out.getvalue().rstrip().endswith("stopped")


def test_run_console_demo_adds_the_demo_stream_and_leaves_silent_runs_to_operators(console, monkeypatch):
    import os
    import signal

    monkeypatch.delenv("ORCHESTRATOR_RUN_AUTO_RECOVER", raising=False)
    monkeypatch.delenv("ORCHESTRATOR_TRANSITION_LOG_LEVEL", raising=False)
    console["on_sleep"] = lambda: console["handlers"][signal.SIGTERM](signal.SIGTERM, None)
    out = StringIO()
    call_command("run_console", "--demo", stdout=out, stderr=StringIO())

    stream = console["children"]["demo_stream"]
    assert stream.args[-1] == "demo_stream" and stream.signals == [signal.SIGTERM]
    assert "(daphne, qcluster, demo_stream)" in out.getvalue()
    assert os.environ["ORCHESTRATOR_RUN_AUTO_RECOVER"] == "0"  # inherited by every child
    assert os.environ["ORCHESTRATOR_TRANSITION_LOG_LEVEL"] == "WARNING"


def test_run_console_exits_with_the_code_of_a_child_that_died(console):
    import signal

    console["exits"]["daphne"] = (2, 3)  # daphne dies on its third poll with exit code 3
    out, err = StringIO(), StringIO()
    with pytest.raises(SystemExit) as raised:
        call_command("run_console", stdout=out, stderr=err)

    assert raised.value.code == 3
    assert "daphne exited with code 3; stopping" in err.getvalue()
    assert console["children"]["qcluster"].signals == [signal.SIGTERM]  # the survivor is stopped
    assert console["children"]["daphne"].signals == []


@pytest.mark.django_db
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "192.168.1.20", "10.0.0.5", "no-such-host.invalid"])
def test_run_console_refuses_a_network_address_while_the_demo_login_has_its_default_password(console, host):
    run_json("seed_demo")  # operator / operator
    with pytest.raises(CommandError, match="demo login 'operator' still has its default password"):
        call_command("run_console", "--host", host, stdout=StringIO(), stderr=StringIO())
    assert console["children"] == {}  # nothing started


@pytest.mark.django_db
@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_run_console_serves_the_demo_login_on_loopback(console, host):
    import signal

    run_json("seed_demo")
    console["on_sleep"] = lambda: console["handlers"][signal.SIGTERM](signal.SIGTERM, None)
    call_command("run_console", "--host", host, stdout=StringIO(), stderr=StringIO())
    assert "daphne" in console["children"]


@pytest.mark.django_db
def test_run_console_serves_the_network_once_the_demo_password_is_changed(console, monkeypatch):
    import signal

    monkeypatch.setenv("DEMO_USERNAME", "demo-admin")
    run_json("seed_demo", "--username", "demo-admin", "--password", "operator")
    with pytest.raises(CommandError, match="'demo-admin'"):
        call_command("run_console", "--host", "0.0.0.0", stdout=StringIO(), stderr=StringIO())
    user = get_user_model().objects.get(username="demo-admin")
    user.set_password("a long unguessable passphrase")
    user.save()
    console["on_sleep"] = lambda: console["handlers"][signal.SIGTERM](signal.SIGTERM, None)
    call_command("run_console", "--host", "0.0.0.0", stdout=StringIO(), stderr=StringIO())
    assert "daphne" in console["children"]


def test_run_console_without_workers_serves_only(console):
    import signal

    console["on_sleep"] = lambda: console["handlers"][signal.SIGTERM](signal.SIGTERM, None)
    out = StringIO()
    call_command("run_console", "--no-workers", stdout=out, stderr=StringIO())
    assert list(console["children"]) == ["daphne"]
    assert "/admin/ (daphne); Ctrl-C" in out.getvalue()


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
