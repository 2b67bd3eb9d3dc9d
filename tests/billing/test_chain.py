"""The ledger's keyed hash chain: ``check_invariants`` catches every rewrite of the ledger, even
one whose chain was recomputed afterwards, unless it was recomputed with the ledger key.

Tampering goes around the application as an attacker with database access would: the
triggers are lifted inside the test's transaction (rolled back with it) and rows are changed
with raw SQL.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
from types import SimpleNamespace

import pytest
from django.apps import apps
from django.db import connection
from django.utils import timezone

from billing.chain import chain_key
from billing.models import CreditAccount, LedgerEntry
from billing.services import account_topup
from runs.invariants import invariants_check
from tests.ledger_guard import ledger_triggers_lifted

pytestmark = pytest.mark.django_db

seal_unkeyed_chains = importlib.import_module("billing.migrations.0004_ledger_keyed_chain").seal_unkeyed_chains


def ledger_violations() -> list[str]:
    return [violation.message for violation in invariants_check(only=["ledger"])]


@pytest.fixture
def organization_id(org) -> int:
    for n in range(3):
        account_topup(organization_id=org.pk, amount=10 + n, reason=f"top-up {n}", idempotency_key=f"t{n}")
    assert ledger_violations() == []
    return org.pk


def entries_of(organization_id: int) -> list[LedgerEntry]:
    return list(LedgerEntry.objects.filter(organization_id=organization_id).order_by("id"))


def raw_update(sql: str, params: list) -> None:
    with ledger_triggers_lifted(connection), connection.cursor() as cursor:
        cursor.execute(sql, params)


def rechain(organization_id: int, digest, *, amount_of: dict[int, int] | None = None) -> list[LedgerEntry]:
    """Rewrite amounts (``{entry id: amount}``) and recompute every hash of the organization's
    chain with ``digest(entry) -> str``, the account's pointer included."""
    previous = ""
    entries = entries_of(organization_id)
    with ledger_triggers_lifted(connection), connection.cursor() as cursor:
        for entry in entries:
            entry.amount = (amount_of or {}).get(entry.pk, entry.amount)
            entry.prev_hash = previous
            entry.entry_hash = digest(entry)
            cursor.execute("UPDATE billing_ledgerentry SET amount = %s, prev_hash = %s, entry_hash = %s WHERE id = %s",
                           [entry.amount, entry.prev_hash, entry.entry_hash, entry.pk])
            previous = entry.entry_hash
    CreditAccount.objects.filter(organization_id=organization_id).update(last_entry_hash=previous)
    return entries


def plain_sha256(entry: LedgerEntry) -> str:
    return hashlib.sha256(entry.hash_body()).hexdigest()


def wrong_key(entry: LedgerEntry) -> str:
    return hmac.new(b"a guessed key", entry.hash_body(), hashlib.sha256).hexdigest()


# --- what the chain is -----------------------------------------------------------------------

def test_entries_are_hashed_with_the_ledger_key_not_plain_sha256(organization_id):
    for entry in entries_of(organization_id):
        assert entry.entry_hash == hmac.new(chain_key(), entry.hash_body(), hashlib.sha256).hexdigest()
        assert entry.entry_hash != plain_sha256(entry)


def test_the_key_is_read_from_the_settings_at_call_time(organization_id, settings):
    entry = entries_of(organization_id)[0]
    derived = entry.compute_hash()
    settings.SECRET_KEY = "another secret key"
    assert entry.compute_hash() != derived  # derived from SECRET_KEY when no ledger key is set
    settings.ORCHESTRATOR_LEDGER_HMAC_KEY = "an explicit ledger key"
    explicit = entry.compute_hash()
    assert explicit == hmac.new(b"an explicit ledger key", entry.hash_body(), hashlib.sha256).hexdigest()
    settings.SECRET_KEY = "yet another secret key"
    assert entry.compute_hash() == explicit  # an explicit key does not follow SECRET_KEY
    # Entries written under one key fail the check under another.
    assert len(ledger_violations()) == len(entries_of(organization_id))


# --- tampering that check_invariants catches -------------------------------------------------

def tamper_amount(organization_id):
    entry = entries_of(organization_id)[1]
    raw_update("UPDATE billing_ledgerentry SET amount = amount + 5 WHERE id = %s", [entry.pk])
    return [f"entry {entry.pk}: content changed after it was written"]


def tamper_delete(organization_id):
    entry = entries_of(organization_id)[1]
    raw_update("DELETE FROM billing_ledgerentry WHERE id = %s", [entry.pk])
    return [f"entry {entry.pk + 1}: chain broken (an entry before it of organization {organization_id} "
            f"changed or vanished)"]


def tamper_reorder(organization_id):
    first, second = entries_of(organization_id)[1:3]
    raw_update("UPDATE billing_ledgerentry SET id = %s WHERE id = %s", [10**9, first.pk])
    raw_update("UPDATE billing_ledgerentry SET id = %s WHERE id = %s", [first.pk, second.pk])
    raw_update("UPDATE billing_ledgerentry SET id = %s WHERE id = %s", [second.pk, 10**9])
    return [f"entry {first.pk}: chain broken (an entry before it of organization {organization_id} "
            f"changed or vanished)"]


def tamper_rechain_sha256(organization_id):
    entry = entries_of(organization_id)[1]
    rewritten = rechain(organization_id, plain_sha256, amount_of={entry.pk: 1_000})
    return [f"entry {e.pk}: content changed after it was written" for e in rewritten]


def tamper_rechain_wrong_key(organization_id):
    entry = entries_of(organization_id)[1]
    rewritten = rechain(organization_id, wrong_key, amount_of={entry.pk: 1_000})
    return [f"entry {e.pk}: content changed after it was written" for e in rewritten]


def tamper_rechain_as_unkeyed(organization_id):
    # Pass the whole chain off as written before keys, with a seal made without the key.
    rewritten = rechain(organization_id, plain_sha256, amount_of={entries_of(organization_id)[1].pk: 1_000})
    end = rewritten[-1]
    forged = hmac.new(b"a guessed key", f"legacy-chain-end:{organization_id}:{end.pk}:{end.entry_hash}".encode(),
                      hashlib.sha256).hexdigest()
    CreditAccount.objects.filter(organization_id=organization_id).update(legacy_chain_end=end.pk,
                                                                         legacy_chain_seal=forged)
    return [f"organization {organization_id}: its unkeyed entries up to {end.pk} do not match their seal"]


@pytest.mark.parametrize("tamper", [tamper_amount, tamper_delete, tamper_reorder, tamper_rechain_sha256,
                                    tamper_rechain_wrong_key, tamper_rechain_as_unkeyed])
def test_check_invariants_catches_the_tampering(organization_id, tamper):
    expected = tamper(organization_id)
    found = ledger_violations()
    for message in expected:
        assert message in found, found


def test_only_the_key_rechains_the_ledger_unnoticed(organization_id):
    # The control of the tests above: the same rewrite, re-chained with the key, passes. The key
    # is the secret (keep ORCHESTRATOR_LEDGER_HMAC_KEY or SECRET_KEY out of an attacker's reach).
    entry = entries_of(organization_id)[1]
    rechain(organization_id, lambda e: e.compute_hash(), amount_of={entry.pk: 1_000})
    assert ledger_violations() == []


# --- entries hashed before the chain was keyed -----------------------------------------------

def unkeyed_history(organization_id: int, amounts: list[int]) -> list[LedgerEntry]:
    """Entries as an installation before keyed chains wrote them (plain SHA-256)."""
    previous, balance, written = "", 0, []
    for n, amount in enumerate(amounts):
        balance += amount
        entry = LedgerEntry(organization_id=organization_id, kind="topup", amount=amount, idempotency_key=f"old{n}",
                            reason="before keyed chains", balance_after=balance, reserved_after=0,
                            prev_hash=previous, created_at=timezone.now())
        entry.entry_hash = entry.compute_legacy_hash()
        entry.save()
        previous = entry.entry_hash
        written.append(entry)
    CreditAccount.objects.filter(organization_id=organization_id).update(balance=balance, last_entry_hash=previous)
    return written


@pytest.fixture
def sealed(org_factory):
    """An organization whose first entries are unkeyed, sealed by the migration, then one keyed entry."""
    organization = org_factory(credits=0)[0]
    old = unkeyed_history(organization.pk, [5, 6, 7])
    assert ledger_violations() == [f"entry {e.pk}: content changed after it was written" for e in old]
    seal_unkeyed_chains(apps, SimpleNamespace(connection=connection))
    account = CreditAccount.objects.get(organization_id=organization.pk)
    assert account.legacy_chain_end == old[-1].pk and len(account.legacy_chain_seal) == 64
    new = account_topup(organization_id=organization.pk, amount=8, reason="after", idempotency_key="new").entry
    assert new.prev_hash == old[-1].entry_hash and new.entry_hash == new.compute_hash()
    assert invariants_check() == []
    return SimpleNamespace(organization_id=organization.pk, old=old, new=new)


def test_the_migration_seals_unkeyed_entries_and_the_check_accepts_them(sealed):
    assert CreditAccount.objects.get(organization_id=sealed.organization_id).balance == 26


def test_a_rewritten_unkeyed_entry_is_still_caught(sealed):
    raw_update("UPDATE billing_ledgerentry SET amount = 50 WHERE id = %s", [sealed.old[1].pk])
    assert f"entry {sealed.old[1].pk}: content changed after it was written" in ledger_violations()


def test_rechaining_the_unkeyed_entries_breaks_their_seal(sealed):
    previous = ""
    with ledger_triggers_lifted(connection), connection.cursor() as cursor:
        for entry in sealed.old:
            entry.amount = 50 if entry.pk == sealed.old[0].pk else entry.amount
            entry.prev_hash = previous
            entry.entry_hash = entry.compute_legacy_hash()
            cursor.execute("UPDATE billing_ledgerentry SET amount = %s, prev_hash = %s, entry_hash = %s WHERE id = %s",
                           [entry.amount, entry.prev_hash, entry.entry_hash, entry.pk])
            previous = entry.entry_hash
    found = ledger_violations()
    assert (f"organization {sealed.organization_id}: its unkeyed entries up to {sealed.old[-1].pk} do not match "
            f"their seal") in found
    assert any(message.startswith(f"entry {sealed.new.pk}: chain broken") for message in found)


def test_moving_or_dropping_the_boundary_is_caught(sealed):
    raw_update("UPDATE billing_ledgerentry SET entry_hash = %s WHERE id = %s",
               [sealed.new.compute_legacy_hash(), sealed.new.pk])
    CreditAccount.objects.filter(organization_id=sealed.organization_id).update(
        legacy_chain_end=sealed.new.pk, last_entry_hash=sealed.new.compute_legacy_hash())
    assert ledger_violations() == [f"organization {sealed.organization_id}: its unkeyed entries up to "
                                   f"{sealed.new.pk} do not match their seal"]
    CreditAccount.objects.filter(organization_id=sealed.organization_id).update(legacy_chain_end=None)
    found = ledger_violations()
    for entry in [*sealed.old, sealed.new]:
        assert f"entry {entry.pk}: content changed after it was written" in found
