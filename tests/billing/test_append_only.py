"""The ledger is append-only on every database: the model layer refuses every rewrite, and the
database's triggers refuse what goes around it (UPDATE, DELETE; TRUNCATE on PostgreSQL).

The test suite's own flush between transactional tests lifts the triggers in its own
transaction (``tests/ledger_guard.py``); the last tests here check that it puts them back.
"""

from __future__ import annotations

import pytest
from django.conf import settings
from django.db import DatabaseError, connection, transaction

from billing.models import AppendOnlyViolation, LedgerEntry
from billing.services import account_topup
from runs.invariants import invariants_check

ON_POSTGRES = settings.DATABASE_IS_POSTGRES
SQLITE_TRIGGERS = ["billing_ledger_no_delete", "billing_ledger_no_update"]
POSTGRES_TRIGGERS = ["billing_ledger_append_only", "billing_ledger_no_truncate"]


@pytest.fixture
def entry(org) -> LedgerEntry:
    return account_topup(organization_id=org.pk, amount=5, reason="seed", idempotency_key="seed").entry


def ledger_triggers() -> list[str]:
    with connection.cursor() as cursor:
        if ON_POSTGRES:
            cursor.execute("SELECT tgname FROM pg_trigger WHERE tgrelid = 'billing_ledgerentry'::regclass "
                           "AND NOT tgisinternal AND tgenabled <> 'D' ORDER BY tgname")
        else:
            cursor.execute("SELECT name FROM sqlite_master WHERE type = 'trigger' "
                           "AND tbl_name = 'billing_ledgerentry' ORDER BY name")
        return [row[0] for row in cursor.fetchall()]


def copy_of(entry: LedgerEntry, **changes) -> LedgerEntry:
    """A new instance that names an existing entry's primary key (never loaded from the database)."""
    fields = {field.attname: getattr(entry, field.attname) for field in LedgerEntry._meta.concrete_fields}
    return LedgerEntry(**{**fields, **changes})


# --- the model layer (every database) -------------------------------------------------------

@pytest.mark.django_db
def test_saving_a_new_instance_that_names_an_existing_entry_is_refused(entry):
    with pytest.raises(AppendOnlyViolation, match=f"entry {entry.pk} exists"):
        copy_of(entry, amount=500, reason="rewritten").save()
    for options in ({"force_update": True}, {"update_fields": ["amount"]}):
        with pytest.raises(AppendOnlyViolation):
            copy_of(entry, amount=500).save(**options)
    fresh = LedgerEntry.objects.get(pk=entry.pk)
    assert (fresh.amount, fresh.reason) == (5, "seed")
    assert invariants_check(only=["ledger", "credits"]) == []


@pytest.mark.django_db
def test_django_internal_update_and_delete_paths_are_refused(entry):
    with pytest.raises(AppendOnlyViolation):
        LedgerEntry._base_manager.filter(pk=entry.pk).update(amount=1)
    with pytest.raises(AppendOnlyViolation):
        LedgerEntry._base_manager.filter(pk=entry.pk)._update({LedgerEntry._meta.get_field("amount"): 1})
    with pytest.raises(AppendOnlyViolation):
        LedgerEntry._base_manager.filter(pk=entry.pk).delete()
    assert LedgerEntry.objects.get(pk=entry.pk).amount == 5


@pytest.mark.django_db
def test_a_new_entry_is_still_inserted(entry):
    result = account_topup(organization_id=entry.organization_id, amount=7, reason="more", idempotency_key="more")
    assert result.created and LedgerEntry.objects.filter(organization_id=entry.organization_id).count() == 3


# --- the database's triggers ----------------------------------------------------------------

@pytest.mark.django_db
def test_the_triggers_are_installed():
    assert ledger_triggers() == (POSTGRES_TRIGGERS if ON_POSTGRES else SQLITE_TRIGGERS)


@pytest.mark.django_db
@pytest.mark.parametrize("sql, operation", [
    ("UPDATE billing_ledgerentry SET amount = 1 WHERE id = %s", "UPDATE"),
    ("UPDATE billing_ledgerentry SET reason = 'edited' WHERE id >= %s", "UPDATE"),
    ("DELETE FROM billing_ledgerentry WHERE id = %s", "DELETE"),
    ("DELETE FROM billing_ledgerentry WHERE id >= %s", "DELETE"),
])
def test_raw_update_and_delete_are_refused_by_the_database(entry, sql, operation):
    with pytest.raises(DatabaseError, match=f"append-only: {operation}"), transaction.atomic(), \
            connection.cursor() as cursor:
        cursor.execute(sql, [entry.pk])
    fresh = LedgerEntry.objects.get(pk=entry.pk)
    assert (fresh.amount, fresh.reason) == (5, "seed")


@pytest.mark.postgres
@pytest.mark.django_db
@pytest.mark.parametrize("sql", [
    "TRUNCATE billing_ledgerentry",
    "TRUNCATE billing_ledgerentry RESTART IDENTITY",
    "TRUNCATE core_organization CASCADE",
])
def test_truncate_is_refused_on_postgres(entry, sql):
    with connection.cursor() as cursor:  # TRUNCATE refuses to run with deferred FK checks pending
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    with pytest.raises(DatabaseError, match="append-only: TRUNCATE"), transaction.atomic(), \
            connection.cursor() as cursor:
        cursor.execute(sql)
    assert LedgerEntry.objects.filter(pk=entry.pk).exists()


# --- the test suite's flush lifts the triggers and puts them back ---------------------------

@pytest.mark.django_db(transaction=True)
def test_a_transactional_test_writes_the_ledger(org):
    account_topup(organization_id=org.pk, amount=3, reason="flushed after this test", idempotency_key="flush")
    assert LedgerEntry.objects.count() == 2  # the initial credits and this one


@pytest.mark.django_db(transaction=True)
def test_the_flush_after_it_emptied_the_ledger_and_restored_the_triggers():
    assert LedgerEntry.objects.count() == 0
    assert ledger_triggers() == (POSTGRES_TRIGGERS if ON_POSTGRES else SQLITE_TRIGGERS)
