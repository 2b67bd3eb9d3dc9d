"""On PostgreSQL the ledger is append-only in the database itself (migrations 0002 and 0005:
UPDATE, DELETE and TRUNCATE are refused; TRUNCATE in tests/billing/test_append_only.py).

Even SQL that goes around the model layer cannot change or remove an entry; inserting works.
Each refused statement runs in its own savepoint so the test's transaction stays usable.
"""

from __future__ import annotations

import pytest
from django.db import DatabaseError, connection, models, transaction
from django.utils import timezone

from billing.models import LedgerEntry
from billing.services import account_topup
from runs.invariants import invariants_check

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]


@pytest.fixture
def entry(org) -> LedgerEntry:
    return account_topup(organization_id=org.pk, amount=40, reason="seed", idempotency_key="seed").entry


def refused(sql: str, params: list | None = None) -> DatabaseError:
    with pytest.raises(DatabaseError) as info, transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql, params or [])
    return info.value


def test_the_trigger_is_installed():
    with connection.cursor() as cursor:
        cursor.execute("SELECT tgname FROM pg_trigger WHERE tgrelid = 'billing_ledgerentry'::regclass "
                       "AND NOT tgisinternal ORDER BY tgname")
        assert [row[0] for row in cursor.fetchall()] == ["billing_ledger_append_only", "billing_ledger_no_truncate"]


@pytest.mark.parametrize("sql", [
    "UPDATE billing_ledgerentry SET amount = 1 WHERE id = %s",
    "UPDATE billing_ledgerentry SET reason = 'edited', amount = amount * 2 WHERE id = %s",
    "UPDATE billing_ledgerentry SET id = id WHERE id = %s",
])
def test_raw_update_is_refused(entry, sql):
    error = refused(sql, [entry.pk])
    assert "append-only" in str(error)
    assert "UPDATE" in str(error)
    fresh = LedgerEntry.objects.get(pk=entry.pk)
    assert (fresh.amount, fresh.reason) == (40, "seed")


@pytest.mark.parametrize("sql", [
    "DELETE FROM billing_ledgerentry WHERE id = %s",
    "DELETE FROM billing_ledgerentry WHERE id >= %s",
])
def test_raw_delete_is_refused(entry, sql):
    error = refused(sql, [entry.pk])
    assert "append-only" in str(error)
    assert "DELETE" in str(error)
    assert LedgerEntry.objects.filter(pk=entry.pk).exists()


def test_orm_calls_that_bypass_the_model_layer_are_refused_too(entry):
    # QuerySet.update/_raw_delete of Django's own class skip LedgerEntryQuerySet's guards.
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        models.QuerySet.update(LedgerEntry.objects.filter(pk=entry.pk), amount=1)
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        models.QuerySet._raw_delete(LedgerEntry.objects.filter(pk=entry.pk), using="default")
    assert LedgerEntry.objects.get(pk=entry.pk).amount == 40
    assert invariants_check(only=["ledger", "credits"]) == []


def test_insert_works(entry):
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO billing_ledgerentry (organization_id, run_id, attempt_number, kind, source, amount, "
            "idempotency_key, actor_id, actor_label, reason, balance_after, reserved_after, prev_hash, entry_hash, "
            "created_at) VALUES (%s, NULL, NULL, 'topup', '', 5, 'raw-insert', NULL, 'system', 'raw', 1045, 0, "
            "%s, 'x', %s) RETURNING id",
            [entry.organization_id, entry.entry_hash, now],
        )
        new_id = cursor.fetchone()[0]
    assert LedgerEntry.objects.get(pk=new_id).amount == 5
    # And through the services, as every real writer does.
    result = account_topup(organization_id=entry.organization_id, amount=7, reason="more", idempotency_key="more")
    assert result.created and LedgerEntry.objects.filter(pk=result.entry.pk).exists()


def test_the_check_constraint_still_refuses_non_positive_amounts(entry):
    error = refused(
        "INSERT INTO billing_ledgerentry (organization_id, kind, source, amount, idempotency_key, actor_label, "
        "reason, balance_after, reserved_after, prev_hash, entry_hash, created_at) "
        "VALUES (%s, 'topup', '', 0, 'zero', 'system', '', 0, 0, '', 'x', now())",
        [entry.organization_id],
    )
    assert "ledger_amount_positive" in str(error)
