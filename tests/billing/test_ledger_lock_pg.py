"""On PostgreSQL a ledger write that waited for the account's lock finds the entry the writer it
waited for appended under the same key (it does not fail on the unique key): the key lookup read
with the lock is read again when an entry was appended while it waited."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, transaction

from billing.models import LedgerEntry
from billing.services import ledger_refund
from runs import services
from tests.conftest import make_plan

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def test_a_write_that_waited_for_the_lock_finds_the_key_appended_meanwhile(project):
    run = services.run_create(project=project, name="lock", plan=make_plan())
    services.run_start(run_id=run.pk)
    args = {"organization_id": run.organization_id, "project_id": run.project_id, "run_id": run.pk,
            "attempt_number": 1, "amount": 1, "source": LedgerEntry.Source.RESERVATION, "idempotency_key": "k"}
    appended, release = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def first() -> None:
        try:
            with transaction.atomic():
                results["first"] = ledger_refund(**args)
                appended.set()
                release.wait(timeout=30)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            results["first"] = exc
        finally:
            appended.set()
            connection.close()

    def second() -> None:
        try:
            results["second"] = ledger_refund(**args)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            results["second"] = exc
        finally:
            connection.close()

    holder = threading.Thread(target=first, daemon=True)
    holder.start()
    assert appended.wait(timeout=30)
    waiter = threading.Thread(target=second, daemon=True)
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive(), "the second write did not wait for the account's lock"
    release.set()
    holder.join(timeout=30)
    waiter.join(timeout=30)
    first_result, second_result = results["first"], results["second"]
    assert not isinstance(first_result, BaseException), repr(first_result)
    assert not isinstance(second_result, BaseException), repr(second_result)
    assert first_result.created and not second_result.created
    assert second_result.entry.pk == first_result.entry.pk
    assert LedgerEntry.objects.filter(run_id=run.pk, kind=LedgerEntry.Kind.REFUND, idempotency_key="k").count() == 1
