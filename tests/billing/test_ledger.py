"""The credits ledger: exactly-once entries, amount validation, append-only rows, refunds.

State is built through the services (``billing.services`` and ``runs.services``); every
assertion reads what they wrote: ledger rows, the account, events and the selectors.
"""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.db import connection, transaction
from django.db.models.deletion import ProtectedError

from billing.errors import InsufficientCredits
from billing.models import AppendOnlyViolation, CreditAccount, LedgerEntry
from billing.selectors import account_balance, ledger_account_sums, ledger_totals
from billing.services import account_topup, ledger_charge, ledger_refund, ledger_reserve
from core.errors import InvalidTransition, ValidationFailed
from core.models import AuditRecord, Event
from runs import services
from runs.invariants import invariants_check
from runs.models import Run, RunAttempt
from tests.conftest import make_plan

BAD_AMOUNTS = [0, -1, -50, 1.5, 2.0, "3", Decimal("3"), None, True]


# --- helpers --------------------------------------------------------------------------------

@pytest.fixture
def operator(django_user_model):
    """A staff user with no usable password (hashing one would cost most of a second per test)."""
    return django_user_model.objects.create_user(username="op", is_staff=True)


def account_of(organization_id: int) -> CreditAccount:
    return CreditAccount.objects.get(organization_id=organization_id)


def figures(organization_id: int) -> tuple[int, int, int, int]:
    """Everything a write could change: balance, reserved, ledger rows, event rows."""
    account = account_of(organization_id)
    return account.balance, account.reserved, LedgerEntry.objects.count(), Event.objects.count()


def created_run(project, *, credit_limit: int | None = None, steps: int = 1) -> Run:
    return services.run_create(project=project, name="ledger", plan=make_plan(steps=steps), credit_limit=credit_limit)


def run_args(run: Run, **extra) -> dict:
    return {"organization_id": run.organization_id, "project_id": run.project_id, "run_id": run.pk,
            "attempt_number": 1, **extra}


def drive_steps(run_id: int) -> None:
    """Begin and succeed every runnable step of a running run until none is left."""
    while steps := services.runnable_steps(Run.objects.get(pk=run_id)):
        attempt = services.step_begin(step_id=steps[0].pk)
        services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True})


def completed_run(project, *, steps: int = 2) -> Run:
    """A run driven to ``completed``: reserved 3 per step, charged 1 per step (echo)."""
    run = created_run(project, steps=steps)
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    drive_steps(run.pk)
    run.refresh_from_db()
    assert run.status == Run.Status.COMPLETED
    return run


# --- exactly-once ---------------------------------------------------------------------------

def test_reserve_charge_refund_repeated_with_the_same_key_change_nothing(project):
    run = created_run(project)
    org_id = run.organization_id
    first = {
        "reserve": ledger_reserve(**run_args(run, amount=10, idempotency_key="k-reserve")),
        "charge": ledger_charge(**run_args(run, amount=4, idempotency_key="k-charge")),
        "refund": ledger_refund(**run_args(run, amount=6, source=LedgerEntry.Source.RESERVATION,
                                           idempotency_key="k-refund")),
    }
    assert all(result.created for result in first.values())
    before = figures(org_id)
    assert before[:2] == (1_000 - 4, 0)

    for _ in range(3):
        again = {
            "reserve": ledger_reserve(**run_args(run, amount=10, idempotency_key="k-reserve")),
            "charge": ledger_charge(**run_args(run, amount=4, idempotency_key="k-charge")),
            "refund": ledger_refund(**run_args(run, amount=6, source=LedgerEntry.Source.RESERVATION,
                                               idempotency_key="k-refund")),
        }
        for kind, result in again.items():
            assert result.created is False, kind
            assert result.entry.pk == first[kind].entry.pk, kind
        assert figures(org_id) == before


def test_repeated_key_with_another_amount_still_changes_nothing(project):
    run = created_run(project)
    ledger_reserve(**run_args(run, amount=10, idempotency_key="once"))
    before = figures(run.organization_id)
    result = ledger_reserve(**run_args(run, amount=99, idempotency_key="once"))
    assert result.created is False
    assert result.entry.amount == 10
    assert figures(run.organization_id) == before


def test_the_same_key_is_independent_per_kind_and_per_run(project):
    run_a, run_b = created_run(project), created_run(project)
    assert ledger_reserve(**run_args(run_a, amount=5, idempotency_key="k")).created
    assert ledger_reserve(**run_args(run_b, amount=5, idempotency_key="k")).created
    assert ledger_charge(**run_args(run_a, amount=2, idempotency_key="k")).created
    assert LedgerEntry.objects.filter(idempotency_key="k").count() == 3


def test_a_charge_said_new_skips_the_lookup_but_a_duplicate_still_fails_and_writes_nothing(project,
                                                                                            django_assert_num_queries):
    run = created_run(project)
    ledger_reserve(**run_args(run, amount=10, idempotency_key="hold"))
    # Lock the account, insert, update it (on PostgreSQL in the insert's statement), the event.
    with transaction.atomic(), django_assert_num_queries(3 if connection.vendor == "postgresql" else 4):
        assert ledger_charge(**run_args(run, amount=2, idempotency_key="step-try-1"), new=True).created
    before = figures(run.organization_id)
    with pytest.raises(ValidationFailed), transaction.atomic():
        ledger_charge(**run_args(run, amount=2, idempotency_key="step-try-1"), new=True)
    assert figures(run.organization_id) == before
    again = ledger_charge(**run_args(run, amount=2, idempotency_key="step-try-1"))  # looked up: the first entry
    assert again.created is False and figures(run.organization_id) == before


def test_topup_repeated_with_the_same_key_changes_nothing(org):
    first = account_topup(organization_id=org.pk, amount=50, reason="invoice 7", idempotency_key="invoice-7")
    assert first.created
    before = figures(org.pk)
    again = account_topup(organization_id=org.pk, amount=50, reason="invoice 7", idempotency_key="invoice-7")
    assert again.created is False and again.entry.pk == first.entry.pk
    assert figures(org.pk) == before
    assert account_of(org.pk).balance == 1_050


# --- amount validation ----------------------------------------------------------------------

@pytest.mark.parametrize("amount", BAD_AMOUNTS, ids=repr)
def test_bad_amounts_raise_validation_failed_and_write_nothing(project, amount):
    run = created_run(project)
    ledger_reserve(**run_args(run, amount=10, idempotency_key="base"))
    org_id = run.organization_id
    before = figures(org_id)
    calls = [
        lambda: account_topup(organization_id=org_id, amount=amount, reason="bad", idempotency_key="bad"),
        lambda: ledger_reserve(**run_args(run, amount=amount, idempotency_key="bad")),
        lambda: ledger_charge(**run_args(run, amount=amount, idempotency_key="bad")),
        lambda: ledger_refund(**run_args(run, amount=amount, source=LedgerEntry.Source.RESERVATION,
                                         idempotency_key="bad")),
        lambda: ledger_refund(**run_args(run, amount=amount, source=LedgerEntry.Source.CHARGE,
                                         idempotency_key="bad")),
    ]
    for call in calls:
        with pytest.raises(ValidationFailed) as info:
            call()
        assert "amount" in info.value.errors
    assert figures(org_id) == before
    assert not LedgerEntry.objects.filter(idempotency_key="bad").exists()


def test_refund_with_an_unknown_source_is_refused(project):
    run = created_run(project)
    ledger_reserve(**run_args(run, amount=10, idempotency_key="base"))
    before = figures(run.organization_id)
    with pytest.raises(ValidationFailed) as info:
        ledger_refund(**run_args(run, amount=1, source="gift", idempotency_key="x"))
    assert "source" in info.value.errors
    assert figures(run.organization_id) == before


def test_topup_needs_a_reason(org):
    before = figures(org.pk)
    for reason in ("", "   "):
        with pytest.raises(ValidationFailed):
            account_topup(organization_id=org.pk, amount=5, reason=reason)
    assert figures(org.pk) == before


# --- limits ---------------------------------------------------------------------------------

def test_reserve_beyond_available_raises_insufficient_credits_and_writes_nothing(project):
    run = created_run(project)
    org_id = run.organization_id
    ledger_reserve(**run_args(run, amount=900, idempotency_key="big"))
    before = figures(org_id)
    with pytest.raises(InsufficientCredits) as info:
        ledger_reserve(**run_args(run, amount=101, idempotency_key="too-much"))
    assert info.value.extra == {"available": 100, "required": 101}
    assert figures(org_id) == before
    # Exactly what is available still works.
    assert ledger_reserve(**run_args(run, amount=100, idempotency_key="rest")).created
    assert account_balance(organization_id=org_id)["available"] == 0


def test_charge_beyond_reserved_raises_insufficient_credits_and_writes_nothing(project):
    run = created_run(project)
    ledger_reserve(**run_args(run, amount=5, idempotency_key="r"))
    before = figures(run.organization_id)
    with pytest.raises(InsufficientCredits):
        ledger_charge(**run_args(run, amount=6, idempotency_key="c"))
    assert figures(run.organization_id) == before


def test_releasing_more_than_reserved_is_refused(project):
    run = created_run(project)
    ledger_reserve(**run_args(run, amount=5, idempotency_key="r"))
    before = figures(run.organization_id)
    with pytest.raises(ValidationFailed):
        ledger_refund(**run_args(run, amount=6, source=LedgerEntry.Source.RESERVATION, idempotency_key="x"))
    assert figures(run.organization_id) == before


def test_run_start_with_insufficient_credits_leaves_the_run_created(org_factory):
    _, project, _ = org_factory(credits=10)
    first = created_run(project, credit_limit=8)
    second = created_run(project, credit_limit=5)  # creation checks availability, it holds nothing
    services.run_start(run_id=first.pk)
    before = figures(project.organization_id)
    with pytest.raises(InsufficientCredits):
        services.run_start(run_id=second.pk)
    second.refresh_from_db()
    assert second.status == Run.Status.CREATED
    assert second.credits_reserved == 0
    assert not RunAttempt.objects.filter(run=second).exists()
    assert figures(project.organization_id) == before
    assert invariants_check() == []


# --- append-only ----------------------------------------------------------------------------

@pytest.fixture
def entry(org) -> LedgerEntry:
    return account_topup(organization_id=org.pk, amount=5, reason="seed", idempotency_key="seed").entry


def test_saving_an_existing_entry_is_refused(entry):
    entry.amount = 500
    with pytest.raises(AppendOnlyViolation):
        entry.save()
    with pytest.raises(AppendOnlyViolation):
        entry.save(update_fields=["amount"])
    fresh = LedgerEntry.objects.get(pk=entry.pk)
    assert fresh.amount == 5
    assert invariants_check(only=["ledger"]) == []


def test_deleting_an_entry_is_refused(entry):
    with pytest.raises(AppendOnlyViolation):
        entry.delete()
    assert LedgerEntry.objects.filter(pk=entry.pk).exists()


def test_queryset_update_and_delete_are_refused(entry):
    with pytest.raises(AppendOnlyViolation):
        LedgerEntry.objects.update(amount=1)
    with pytest.raises(AppendOnlyViolation):
        LedgerEntry.objects.filter(pk=entry.pk).update(reason="edited")
    with pytest.raises(AppendOnlyViolation):
        LedgerEntry.objects.all().delete()
    with pytest.raises(AppendOnlyViolation):
        LedgerEntry.objects.filter(pk=entry.pk).delete()
    fresh = LedgerEntry.objects.get(pk=entry.pk)
    assert (fresh.amount, fresh.reason) == (5, "seed")


def test_bulk_update_update_or_create_and_raw_delete_are_refused(entry):
    entry.amount = 9
    # bulk_update runs in atomic(savepoint=False): its refusal dooms the enclosing transaction,
    # so give it its own savepoint as real callers would.
    with pytest.raises(AppendOnlyViolation), transaction.atomic():
        LedgerEntry.objects.bulk_update([entry], ["amount"])
    with pytest.raises(AppendOnlyViolation):
        LedgerEntry.objects.update_or_create(pk=entry.pk, defaults={"reason": "edited"})
    with pytest.raises(AppendOnlyViolation):
        LedgerEntry.objects.filter(pk=entry.pk)._raw_delete(using="default")
    fresh = LedgerEntry.objects.get(pk=entry.pk)
    assert (fresh.amount, fresh.reason) == (5, "seed")


def test_rows_the_ledger_refers_to_cannot_be_deleted_from_under_it(project):
    run = completed_run(project, steps=1)
    with pytest.raises(ProtectedError):
        Run.objects.filter(pk=run.pk).delete()
    assert LedgerEntry.objects.filter(run=run).count() == 3


# --- top-up, available, actor and reason, events --------------------------------------------

def test_account_topup_adds_to_the_balance_with_actor_reason_event_and_audit(org, operator):
    result = account_topup(organization_id=org.pk, amount=250, reason="contract renewal", actor=operator)
    entry = result.entry
    assert result.created
    assert (entry.kind, entry.amount, entry.run_id, entry.attempt_number) == (LedgerEntry.Kind.TOPUP, 250, None, None)
    assert (entry.actor, entry.actor_label, entry.reason) == (operator, "op", "contract renewal")
    assert (entry.balance_after, entry.reserved_after) == (1_250, 0)
    assert account_balance(organization_id=org.pk) == {"organization": org.pk, "balance": 1_250, "reserved": 0,
                                                       "available": 1_250}
    event = Event.objects.get(type="ledger_topup", payload__entry=entry.pk)
    assert event.organization_id == org.pk
    assert event.payload["amount"] == 250 and event.payload["balance"] == 1_250
    audit = AuditRecord.objects.get(action="credits_topup", target_id=str(org.pk), reason="contract renewal")
    assert audit.actor == operator
    assert (audit.before, audit.after) == ({"balance": 1_000}, {"balance": 1_250})


def test_topups_without_a_key_are_distinct_entries(org):
    first = account_topup(organization_id=org.pk, amount=1, reason="a")
    second = account_topup(organization_id=org.pk, amount=1, reason="a")
    assert first.created and second.created and first.entry.pk != second.entry.pk
    assert account_of(org.pk).balance == 1_002


def test_available_is_balance_minus_reserved(project):
    run = created_run(project)
    org_id = run.organization_id
    ledger_reserve(**run_args(run, amount=300, idempotency_key="r"))
    account = account_of(org_id)
    assert (account.balance, account.reserved, account.available) == (1_000, 300, 700)
    ledger_charge(**run_args(run, amount=120, idempotency_key="c"))
    account = account_of(org_id)
    assert (account.balance, account.reserved, account.available) == (880, 180, 700)
    ledger_refund(**run_args(run, amount=180, source=LedgerEntry.Source.RESERVATION, idempotency_key="s"))
    ledger_refund(**run_args(run, amount=20, source=LedgerEntry.Source.CHARGE, idempotency_key="back"))
    account = account_of(org_id)
    assert (account.balance, account.reserved, account.available) == (900, 0, 900)
    assert account_balance(organization_id=org_id) == {"organization": org_id, "balance": 900, "reserved": 0,
                                                       "available": 900}
    assert ledger_account_sums(organization_id=org_id) == {"balance": 900, "reserved": 0}


def test_ledger_entries_carry_actor_and_reason(project, operator):
    run = created_run(project)
    reserve = ledger_reserve(**run_args(run, amount=10, idempotency_key="r", actor=operator, reason="manual hold"))
    charge = ledger_charge(**run_args(run, amount=3, idempotency_key="c", reason="tool call"))
    assert (reserve.entry.actor, reserve.entry.actor_label, reserve.entry.reason) == (operator, "op", "manual hold")
    assert (charge.entry.actor, charge.entry.actor_label, charge.entry.reason) == (None, "system", "tool call")

    services.run_start(run_id=run.pk, actor=operator, reason="go")
    start_reserve = LedgerEntry.objects.get(run=run, idempotency_key="attempt:1:reserve")
    assert (start_reserve.actor, start_reserve.reason) == (operator, "go")
    services.run_cancel(run_id=run.pk, actor=operator, reason="customer asked")
    settle = LedgerEntry.objects.get(run=run, idempotency_key="attempt:1:settle")
    assert (settle.actor, settle.actor_label, settle.reason) == (operator, "op", "customer asked")
    assert settle.source == LedgerEntry.Source.RESERVATION


def test_every_ledger_entry_writes_one_event_in_its_transaction(project, operator):
    run = completed_run(project, steps=2)
    account_topup(organization_id=run.organization_id, amount=7, reason="bonus", idempotency_key="bonus")
    services.run_refund(run_id=run.pk, amount=1, actor=operator, reason="goodwill", idempotency_key="gw")
    entries = list(LedgerEntry.objects.filter(organization_id=run.organization_id))
    # initial top-up, reserve, 2 charges, settle, bonus top-up, refund of a charge
    assert [e.kind for e in entries] == ["topup", "reserve", "charge", "charge", "refund", "topup", "refund"]
    ledger_events = Event.objects.filter(type__startswith="ledger_")
    assert ledger_events.count() == len(entries)
    by_entry = {event.payload["entry"]: event for event in ledger_events}
    for entry in entries:
        event = by_entry[entry.pk]
        assert event.type == f"ledger_{entry.kind}"
        assert event.organization_id == entry.organization_id
        assert event.run_id == entry.run_id
        assert event.payload["amount"] == entry.amount
        assert event.payload["source"] == entry.source
        assert event.payload["balance"] == entry.balance_after
        assert event.payload["reserved"] == entry.reserved_after
        assert event.payload["available"] == entry.balance_after - entry.reserved_after


def test_a_refused_write_leaves_no_event(project):
    run = created_run(project, credit_limit=5)
    before = figures(run.organization_id)
    with pytest.raises(InsufficientCredits):
        ledger_reserve(**run_args(run, amount=5_000, idempotency_key="x"))
    assert figures(run.organization_id) == before


def test_entries_chain_their_hashes(project):
    completed_run(project, steps=2)
    entries = list(LedgerEntry.objects.filter(organization_id=project.organization_id))
    assert entries[0].prev_hash == ""
    for previous, entry in zip(entries, entries[1:]):
        assert entry.prev_hash == previous.entry_hash
        assert entry.entry_hash == entry.compute_hash()
    assert account_of(project.organization_id).last_entry_hash == entries[-1].entry_hash
    assert invariants_check() == []


# --- refunds of charged credits (run_refund) ------------------------------------------------

def test_full_refund_gives_every_charged_credit_back(project, operator):
    run = completed_run(project, steps=2)
    assert (run.credits_reserved, run.credits_charged, run.credits_refunded) == (6, 2, 4)
    refunded = services.run_refund(run_id=run.pk, actor=operator, reason="outage", idempotency_key="full")
    assert refunded == 2
    run.refresh_from_db()
    assert (run.credits_reserved, run.credits_charged, run.credits_refunded) == (6, 0, 6)
    entry = LedgerEntry.objects.get(run=run, kind=LedgerEntry.Kind.REFUND, idempotency_key="full")
    assert (entry.source, entry.amount, entry.actor, entry.reason) == (LedgerEntry.Source.CHARGE, 2, operator, "outage")
    assert account_balance(organization_id=run.organization_id)["balance"] == 1_000
    assert ledger_totals(run_id=run.pk) == {"reserved": 6, "charged": 0, "refunded": 6}
    audit = AuditRecord.objects.get(action="run_refund", run_id=run.pk)
    assert audit.before["credits_charged"] == 2 and audit.after["credits_charged"] == 0
    assert Event.objects.filter(type="run_refunded", run_id=run.pk, payload__amount=2).count() == 1
    assert invariants_check() == []
    # Nothing left to refund.
    with pytest.raises(ValidationFailed):
        services.run_refund(run_id=run.pk, actor=operator, reason="again", idempotency_key="full-2")
    with pytest.raises(ValidationFailed):
        services.run_refund(run_id=run.pk, amount=1, actor=operator, reason="again", idempotency_key="full-3")


def test_partial_refunds_never_exceed_the_charge(project, operator):
    run = completed_run(project, steps=3)
    assert run.credits_charged == 3
    assert services.run_refund(run_id=run.pk, amount=1, actor=operator, reason="p1", idempotency_key="p1") == 1
    assert services.run_refund(run_id=run.pk, amount=1, actor=operator, reason="p2", idempotency_key="p2") == 1
    before = figures(run.organization_id)
    with pytest.raises(ValidationFailed) as info:
        services.run_refund(run_id=run.pk, amount=2, actor=operator, reason="p3", idempotency_key="p3")
    assert info.value.errors == {"amount": ["at most 1"]}
    assert figures(run.organization_id) == before
    assert services.run_refund(run_id=run.pk, amount=1, actor=operator, reason="p3", idempotency_key="p3") == 1
    run.refresh_from_db()
    assert (run.credits_charged, run.credits_refunded) == (0, run.credits_reserved)
    assert account_balance(organization_id=run.organization_id)["balance"] == 1_000
    assert invariants_check() == []


def test_refund_repeated_with_the_same_key_refunds_nothing(project, operator):
    run = completed_run(project, steps=2)
    assert services.run_refund(run_id=run.pk, amount=1, actor=operator, reason="once", idempotency_key="once") == 1
    before = figures(run.organization_id)
    for _ in range(3):
        assert services.run_refund(run_id=run.pk, amount=1, actor=operator, reason="once",
                                   idempotency_key="once") == 0
    assert figures(run.organization_id) == before
    run.refresh_from_db()
    assert run.credits_charged == 1
    assert invariants_check() == []


def test_refund_spread_over_attempts_is_exactly_once(project, operator):
    # Attempt 1: one step charged (1), then fatal failure of the second (charged 1) → failed.
    run = services.run_create(project=project, name="two attempts", plan=make_plan(steps=2))
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    steps = services.runnable_steps(Run.objects.get(pk=run.pk))
    services.step_attempt_succeed(attempt_id=services.step_begin(step_id=steps[0].pk).pk)
    steps = services.runnable_steps(Run.objects.get(pk=run.pk))
    services.step_attempt_fail(attempt_id=services.step_begin(step_id=steps[0].pk).pk, code="boom",
                               message="fatal", retryable=False)
    run.refresh_from_db()
    assert run.status == Run.Status.FAILED and run.credits_charged == 2
    # Attempt 2 completes: charged 2 more.
    services.run_retry(run_id=run.pk, actor=operator, reason="try again")
    services.run_requeue(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    drive_steps(run.pk)
    run.refresh_from_db()
    assert run.status == Run.Status.COMPLETED
    assert run.credits_charged == 4
    assert invariants_check() == []

    # 3 credits: 2 from attempt 2, 1 from attempt 1.
    assert services.run_refund(run_id=run.pk, amount=3, actor=operator, reason="split", idempotency_key="split") == 3
    assert ledger_totals(run_id=run.pk, attempt_number=2)["charged"] == 0
    assert ledger_totals(run_id=run.pk, attempt_number=1)["charged"] == 1
    before = figures(run.organization_id)
    for _ in range(2):
        assert services.run_refund(run_id=run.pk, amount=3, actor=operator, reason="split",
                                   idempotency_key="split") == 0
    assert figures(run.organization_id) == before
    run.refresh_from_db()
    assert (run.credits_charged, run.credits_refunded) == (1, run.credits_reserved - 1)
    assert invariants_check() == []


def test_repeated_split_refund_key_never_refunds_twice(project, operator):
    # Attempt 1 charges 3 (two successes, then a fatal failure); attempt 2 charges 1, then is cancelled.
    run = services.run_create(project=project, name="split", plan=make_plan(steps=3))
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    for outcome in ("ok", "ok", "fatal"):
        step = services.runnable_steps(Run.objects.get(pk=run.pk))[0]
        attempt = services.step_begin(step_id=step.pk)
        if outcome == "ok":
            services.step_attempt_succeed(attempt_id=attempt.pk)
        else:
            services.step_attempt_fail(attempt_id=attempt.pk, code="boom", message="fatal", retryable=False)
    services.run_retry(run_id=run.pk, reason="again")
    services.run_requeue(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    step = services.runnable_steps(Run.objects.get(pk=run.pk))[0]
    services.step_attempt_succeed(attempt_id=services.step_begin(step_id=step.pk).pk)
    services.run_cancel(run_id=run.pk, reason="enough")
    run.refresh_from_db()
    assert run.status == Run.Status.CANCELLED and run.credits_charged == 4

    # 2 credits: 1 from attempt 2, 1 from attempt 1 (two ledger entries under one request key).
    assert services.run_refund(run_id=run.pk, amount=2, actor=operator, reason="r", idempotency_key="K") == 2
    before = figures(run.organization_id)
    assert services.run_refund(run_id=run.pk, amount=2, actor=operator, reason="r", idempotency_key="K") == 0
    assert figures(run.organization_id) == before
    run.refresh_from_db()
    assert run.credits_charged == 2
    assert invariants_check() == []


def test_repeated_full_refund_key_returns_zero(project, operator):
    run = completed_run(project, steps=2)
    assert services.run_refund(run_id=run.pk, actor=operator, reason="all", idempotency_key="all") == 2
    before = figures(run.organization_id)
    assert services.run_refund(run_id=run.pk, actor=operator, reason="all", idempotency_key="all") == 0
    assert figures(run.organization_id) == before


def test_refund_needs_a_settled_run_a_reason_and_a_positive_amount(project, operator):
    run = created_run(project, steps=2)
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    steps = services.runnable_steps(Run.objects.get(pk=run.pk))
    services.step_attempt_succeed(attempt_id=services.step_begin(step_id=steps[0].pk).pk)
    before = figures(run.organization_id)
    with pytest.raises(InvalidTransition):
        services.run_refund(run_id=run.pk, amount=1, actor=operator, reason="early")
    assert figures(run.organization_id) == before
    services.run_pause(run_id=run.pk)
    with pytest.raises(InvalidTransition):
        services.run_refund(run_id=run.pk, amount=1, actor=operator, reason="early")
    services.run_cancel(run_id=run.pk, actor=operator, reason="stop")
    before = figures(run.organization_id)
    with pytest.raises(ValidationFailed):
        services.run_refund(run_id=run.pk, amount=1, actor=operator, reason="  ")
    for amount in (0, -1, 1.0, "1", True):
        with pytest.raises(ValidationFailed):
            services.run_refund(run_id=run.pk, amount=amount, actor=operator, reason="bad")
    assert figures(run.organization_id) == before
    # A cancelled run that was charged can be refunded.
    assert services.run_refund(run_id=run.pk, actor=operator, reason="sorry") == 1
    assert invariants_check() == []


def test_refund_of_a_run_that_charged_nothing_is_refused(project, operator):
    run = created_run(project)
    services.run_start(run_id=run.pk)
    services.run_cancel(run_id=run.pk)
    before = figures(run.organization_id)
    with pytest.raises(ValidationFailed):
        services.run_refund(run_id=run.pk, actor=operator, reason="nothing to give")
    assert figures(run.organization_id) == before


# --- selectors agree with the account -------------------------------------------------------

def test_selectors_agree_with_the_account_and_the_run_counters(org_factory, operator):
    _, project, _ = org_factory(credits=100)
    completed = completed_run(project, steps=3)
    cancelled = created_run(project, steps=2)
    services.run_start(run_id=cancelled.pk)
    services.run_mark_running(run_id=cancelled.pk)
    steps = services.runnable_steps(Run.objects.get(pk=cancelled.pk))
    services.step_attempt_succeed(attempt_id=services.step_begin(step_id=steps[0].pk).pk)
    services.run_cancel(run_id=cancelled.pk, reason="enough")
    running = created_run(project, steps=2)
    services.run_start(run_id=running.pk)
    services.run_refund(run_id=completed.pk, amount=2, actor=operator, reason="partial", idempotency_key="p")
    account_topup(organization_id=project.organization_id, amount=11, reason="bonus")

    for run in (completed, cancelled, running):
        run.refresh_from_db()
        totals = ledger_totals(run_id=run.pk)
        assert totals == {"reserved": run.credits_reserved, "charged": run.credits_charged,
                          "refunded": run.credits_refunded}
        for attempt in RunAttempt.objects.filter(run=run):
            assert ledger_totals(run_id=run.pk, attempt_number=attempt.number) == {
                "reserved": attempt.credits_reserved, "charged": attempt.credits_charged,
                "refunded": attempt.credits_refunded}
    assert ledger_totals(run_id=completed.pk) == {"reserved": 9, "charged": 1, "refunded": 8}
    assert ledger_totals(run_id=cancelled.pk) == {"reserved": 6, "charged": 1, "refunded": 5}
    assert ledger_totals(run_id=running.pk) == {"reserved": 6, "charged": 0, "refunded": 0}

    account = account_of(project.organization_id)
    sums = ledger_account_sums(organization_id=project.organization_id)
    assert sums == {"balance": account.balance, "reserved": account.reserved}
    # 100 + 11 top-ups, 3 + 1 charged, 2 refunded; only the live run holds credits.
    assert (account.balance, account.reserved) == (100 + 11 - 4 + 2, 6)
    assert account_balance(organization_id=project.organization_id)["available"] == account.balance - 6
    assert invariants_check() == []


def test_selectors_of_an_organization_without_entries(org_factory):
    organization, _, _ = org_factory(credits=0)
    assert ledger_account_sums(organization_id=organization.pk) == {"balance": 0, "reserved": 0}
    assert account_balance(organization_id=organization.pk) == {"organization": organization.pk, "balance": 0,
                                                                "reserved": 0, "available": 0}
