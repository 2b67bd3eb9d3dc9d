"""``create_organization``: onboarding an organization with its owner, project and credit account.

Commands parse arguments and call one service; a domain error becomes a ``CommandError``
with a readable message, never a traceback.
"""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError

from billing.models import CreditAccount, LedgerEntry
from billing.selectors import account_balance
from core.models import Membership, Organization, Project
from runs.invariants import invariants_check


def run_command(name: str, *args: str) -> str:
    out = StringIO()
    call_command(name, *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def run_json(name: str, *args: str) -> dict:
    return json.loads(run_command(name, *args))


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
