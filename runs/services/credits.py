"""A run's credits: the reservation of an attempt, step charges (exactly once per idempotency key),
the settlement of what was not charged, and operator refunds.
"""

from __future__ import annotations

import uuid


from billing.errors import CreditLimitExceeded
from billing.models import LedgerEntry
from billing.services import (
    LedgerResult,
    RunEntry,
    ledger_charge,
    ledger_charge_entry,
    ledger_refund,
    ledger_refund_entry,
    ledger_reserve,
    ledger_reserve_entry,
    ledger_run_entries,
)
from core.errors import (
    InvalidTransition,
    ValidationFailed,
)
from core.fsm import moves_may_wait
from core.services import audit_record
from runs.events import RUN_REFUNDED
from runs.models import (
    SETTLED_RUN_STATES,
    Run,
    RunAttempt,
)
from runs.outbox import run_atomic, run_deferred, run_deferred_flush, run_deferred_take, run_event_record
from runs.services.common import _lock_run, _snapshot


def _reserve(run: Run, attempt: RunAttempt, *, actor=None, reason: str = "") -> None:
    """Reserve the run's ``credit_limit`` for ``attempt`` (a new attempt not yet saved is inserted
    with it: its key names an attempt that did not exist, so the ledger does not look it up)."""
    result = _ledger_after_charges(run.organization_id, ledger_reserve_entry(
        organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
        attempt_number=attempt.number, amount=run.credit_limit, idempotency_key=f"attempt:{attempt.number}:reserve",
        actor=actor, reason=reason or f"reserve for attempt {attempt.number}", emit=run_event_record,
        new=attempt.pk is None))
    if result.created:
        attempt.credits_reserved += run.credit_limit
        run.credits_reserved += run.credit_limit
    if attempt.pk is None:
        with moves_may_wait():  # a new row: the account's update a batch keeps goes on waiting
            attempt.save()
    elif result.created:
        attempt.save(update_fields=["credits_reserved"])


def _reserve_replan(run: Run, attempt: RunAttempt, *, amount: int, replan_number: int) -> None:
    """Hold a re-plan's worst-case cost on top of the attempt's reservation (released with the rest
    when the attempt ends); ``InsufficientCredits`` when the organization cannot pay it."""
    with run_atomic():
        run_deferred_flush()
        result = ledger_reserve(organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                                attempt_number=attempt.number, amount=amount,
                                idempotency_key=f"replan:{run.pk}:{attempt.number}:{replan_number}",
                                reason=f"reserve for re-plan {replan_number} of attempt {attempt.number}",
                                emit=run_event_record)
    if result.created:
        attempt.credits_reserved += amount
        run.credits_reserved += amount
        attempt.save(update_fields=["credits_reserved"])
        run.save(update_fields=["credits_reserved", "updated_at"])


def _charge(run: Run, attempt: RunAttempt, *, amount: int, key: str, reason: str, save: bool = True) -> bool:
    """Charge an attempt's reservation for a step attempt being settled (``key``: the step
    attempt's, charged in the transaction that settles it, so never charged before: the ledger
    does not look it up; a duplicate still fails on its unique key); ``CreditLimitExceeded`` when
    it would go past the reservation. The ledger entry is written at the end of the transaction
    (``run_deferred``: the account's lock, which every run of the organization takes, is held
    that long only), its event in its place; the attempt's and the run's figures move at once
    (``save=False``: the caller saves the attempt's ``credits_charged``)."""
    remaining = attempt.credits_reserved - attempt.credits_charged - attempt.credits_refunded
    if amount > remaining:
        if LedgerEntry.objects.filter(run_id=run.pk, kind=LedgerEntry.Kind.CHARGE, idempotency_key=key).exists():
            return False  # charged already: a repeat is not refused for what the first one took
        raise CreditLimitExceeded(
            f"run {run.pk} attempt {attempt.number}: charging {amount} would exceed the reservation "
            f"({remaining} of {attempt.credits_reserved} left)", run=run.pk, remaining=remaining)
    # The organization's account is locked at the end of the transaction only.
    run_deferred(_ChargeWrite(organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                              attempt_number=attempt.number, amount=amount, idempotency_key=key, reason=reason))
    attempt.credits_charged += amount
    run.credits_charged += amount
    if save:
        attempt.save(update_fields=["credits_charged"])
    return True


class _ChargeWrite:
    """A step attempt's charge put off to the end of the transaction (``run_deferred``): written
    alone there, or with the entry of the account that another write makes first
    (``_ledger_after_charges``)."""

    def __init__(self, **entry) -> None:
        self.entry = entry

    def __call__(self, emit) -> None:
        ledger_charge(**self.entry, emit=emit, new=True)


def _ledger_after_charges(organization_id: int, entry: RunEntry) -> LedgerResult:
    """Append ``entry`` after the transaction's put-off charges, which are written now (the account's
    entries in order): the organization's charges and ``entry`` under one lock of its account (one
    read, one insert and one update of it)."""
    batch: list[RunEntry] = []
    for write, sink in run_deferred_take():
        if isinstance(write, _ChargeWrite) and write.entry["organization_id"] == organization_id:
            batch.append(ledger_charge_entry(**write.entry, emit=sink, new=True))
            continue
        if batch:
            ledger_run_entries(organization_id=organization_id, entries=batch)
            batch = []
        write(sink)
    return ledger_run_entries(organization_id=organization_id, entries=[*batch, entry])[-1]


def _settle(run: Run, attempt: RunAttempt | None, *, actor=None, reason: str = "", save: bool = True) -> None:
    """Release what the attempt reserved and did not charge: ``charged + refunded = reserved``
    (``save=False``: the caller saves the attempt, ``_close_attempt``)."""
    if attempt is None:
        return
    remaining = attempt.credits_reserved - attempt.credits_charged - attempt.credits_refunded
    if remaining <= 0:
        return
    result = _ledger_after_charges(run.organization_id, ledger_refund_entry(
        organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
        attempt_number=attempt.number, amount=remaining, source=LedgerEntry.Source.RESERVATION,
        idempotency_key=f"attempt:{attempt.number}:settle", actor=actor,
        reason=reason or f"release unused reservation of attempt {attempt.number}", emit=run_event_record))
    if result.created:
        attempt.credits_refunded += remaining
        run.credits_refunded += remaining
        if save:
            attempt.save(update_fields=["credits_refunded"])


@run_atomic()
def run_refund(*, run_id: int, amount: int | None = None, actor=None, reason: str,
               idempotency_key: str | None = None) -> int:
    """Give charged credits of a settled run back to its organization (full or partial).

    Never more than the run's net charge. Returns the amount refunded (0 on a repeated key).
    """
    if not (reason or "").strip():
        raise ValidationFailed("a reason is required", errors={"reason": ["must not be empty"]})
    run = _lock_run(run_id)
    if run.status not in SETTLED_RUN_STATES:
        raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="refund",
                                why="only completed, failed or cancelled runs can be refunded")
    key = idempotency_key or f"manual:{uuid.uuid4().hex}"
    # A refund spread over several attempts is written under per-attempt keys: look for all of them,
    # before checking the amount (a repeated request answers 0 even once nothing is left to refund).
    attempt_keys = [f"{key}:attempt:{n}" for n in RunAttempt.objects.filter(run=run).values_list("number", flat=True)]
    if LedgerEntry.objects.filter(run_id=run.pk, kind=LedgerEntry.Kind.REFUND,
                                  idempotency_key__in=[key, *attempt_keys]).exists():
        return 0
    refundable = run.credits_charged
    if amount is None:
        amount = refundable
    if isinstance(amount, bool) or not isinstance(amount, int) or amount <= 0:
        raise ValidationFailed("refund amount must be positive", errors={"amount": ["must be greater than zero"]})
    if amount > refundable:
        raise ValidationFailed(f"cannot refund {amount}: only {refundable} charged and not yet refunded",
                               errors={"amount": [f"at most {refundable}"]})
    before = _snapshot(run)
    left = amount
    run_deferred_flush()
    for attempt in RunAttempt.objects.filter(run=run).order_by("-number"):
        take = min(left, attempt.credits_charged)
        if take <= 0:
            continue
        ledger_refund(organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                      attempt_number=attempt.number, amount=take, source=LedgerEntry.Source.CHARGE,
                      idempotency_key=f"{key}:attempt:{attempt.number}" if take != amount else key,
                      actor=actor, reason=reason, emit=run_event_record)
        attempt.credits_charged -= take
        attempt.credits_refunded += take
        attempt.save(update_fields=["credits_charged", "credits_refunded"])
        left -= take
        if left == 0:
            break
    run.credits_charged -= amount
    run.credits_refunded += amount
    run.save(update_fields=["credits_charged", "credits_refunded", "updated_at"])
    run_event_record(type=RUN_REFUNDED, organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                     payload={"run": run.pk, "amount": amount, "reason": reason})
    audit_record(actor=actor, action="run_refund", target_type="run", target_id=run.pk,
                 organization_id=run.organization_id, run_id=run.pk, reason=reason, before=before,
                 after=_snapshot(run))
    return amount

