"""The only writers of credits: open accounts, top up, reserve, charge, refund, debit directly.

Every function runs in the caller's transaction (or its own), locks the organization's
``CreditAccount`` row, and is idempotent: an entry is identified by ``(run, kind, key)`` (or
``(organization, kind, key)`` without a run), and repeating a call with the same key returns
the existing entry and changes nothing. Lock order across the project is run → job → account.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

from django.contrib.auth import get_user_model
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from billing.errors import InsufficientCredits
from billing.events import ledger_event
from billing.models import CreditAccount, LedgerEntry
from core.errors import NotFound, ValidationFailed
from core.events import ORGANIZATION_CREATED
from core.models import Membership, Organization, Project
from core.services import actor_label, audit_record, event_record, transition_log


@dataclass(frozen=True)
class LedgerResult:
    entry: LedgerEntry
    created: bool


# Writes an event row (``core.services.event_record``'s keyword arguments); a caller batching its
# transaction's events passes its own, which keeps the row in order with the others.
EventSink = Callable[..., Any]

MAX_AMOUNT = 10**15  # credits in one ledger entry (the API's limit too); balances stay far from 64 bits


def _validate_amount(amount) -> int:
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise ValidationFailed("amount must be a whole number of credits", errors={"amount": ["must be an integer"]})
    if amount <= 0:
        raise ValidationFailed("amount must be positive", errors={"amount": ["must be greater than zero"]})
    if amount > MAX_AMOUNT:
        raise ValidationFailed("amount is too large", errors={"amount": [f"at most {MAX_AMOUNT:,} credits"]})
    return amount


def account_open(*, organization: Organization) -> CreditAccount:
    """Create the organization's credit account (no-op when it exists)."""
    account, _ = CreditAccount.objects.get_or_create(organization=organization)
    return account


def _account_locked(organization_id: int) -> CreditAccount:
    try:
        return CreditAccount.objects.select_for_update().get(organization_id=organization_id)
    except CreditAccount.DoesNotExist as exc:
        if not Organization.objects.filter(pk=organization_id).exists():
            raise NotFound(f"organization {organization_id} does not exist") from exc
        # An organization created outside the onboarding service: open its account now.
        CreditAccount.objects.get_or_create(organization_id=organization_id)
        return CreditAccount.objects.select_for_update().get(organization_id=organization_id)


def _existing(*, organization_id: int, run_id: int | None, kind: str, key: str) -> LedgerEntry | None:
    if run_id is not None:
        return LedgerEntry.objects.filter(run_id=run_id, kind=kind, idempotency_key=key).first()
    return LedgerEntry.objects.filter(organization_id=organization_id, run__isnull=True, kind=kind,
                                      idempotency_key=key).first()


def _append(
    *,
    account: CreditAccount,
    kind: str,
    amount: int,
    key: str,
    run_id: int | None,
    attempt_number: int | None,
    project_id: int | None,
    source: str = "",
    actor=None,
    reason: str = "",
    emit: EventSink | None = None,
) -> LedgerEntry:
    """Append an entry for movements already applied to ``account`` (locked), then save both.

    The entry's key was looked up under the account's row lock, which every writer of the
    organization's entries holds, so no concurrent writer can insert the same key: no savepoint.
    A duplicate written around the services still fails (``ValidationFailed``) and, being a
    failed statement, fails the caller's transaction with it."""
    entry = LedgerEntry(
        organization_id=account.organization_id,
        run_id=run_id,
        attempt_number=attempt_number,
        kind=kind,
        source=source,
        amount=amount,
        idempotency_key=key,
        actor=actor if getattr(actor, "pk", None) else None,
        actor_label=actor_label(actor),
        reason=reason or "",
        balance_after=account.balance,
        reserved_after=account.reserved,
        prev_hash=account.last_entry_hash,
        created_at=timezone.now(),
    )
    entry.entry_hash = entry.compute_hash()
    try:
        entry.save()
    except IntegrityError as exc:  # a concurrent writer used the same key first
        raise ValidationFailed(f"ledger key {key!r} already used for {kind}",
                               errors={"idempotency_key": ["already used"]}) from exc
    account.last_entry_hash = entry.entry_hash
    account.save(update_fields=["balance", "reserved", "last_entry_hash", "updated_at"])
    (emit or event_record)(
        type=ledger_event(kind),
        organization_id=account.organization_id,
        project_id=project_id,
        run_id=run_id,
        payload={"entry": entry.pk, "kind": kind, "source": source, "amount": amount, "attempt": attempt_number,
                 "balance": account.balance, "reserved": account.reserved, "available": account.available},
    )
    transition_log(entity="ledger", id=entry.pk, kind=kind, amount=amount, run=run_id, attempt=attempt_number,
                   organization=account.organization_id, key=key)
    return entry


@transaction.atomic
def account_topup(*, organization_id: int, amount: int, reason: str, actor=None,
                  idempotency_key: str | None = None) -> LedgerResult:
    """Add credits to an organization's balance (a ``topup`` entry)."""
    amount = _validate_amount(amount)
    if not (reason or "").strip():
        raise ValidationFailed("a reason is required", errors={"reason": ["must not be empty"]})
    account = _account_locked(organization_id)
    key = idempotency_key or f"topup:{timezone.now().isoformat()}:{account.last_entry_hash[:12]}"
    existing = _existing(organization_id=organization_id, run_id=None, kind=LedgerEntry.Kind.TOPUP, key=key)
    if existing is not None:
        return LedgerResult(existing, False)
    before = {"balance": account.balance}
    account.balance += amount
    entry = _append(account=account, kind=LedgerEntry.Kind.TOPUP, amount=amount, key=key, run_id=None,
                    attempt_number=None, project_id=None, actor=actor, reason=reason)
    audit_record(actor=actor, action="credits_topup", target_type="organization", target_id=organization_id,
                 organization_id=organization_id, reason=reason, before=before, after={"balance": account.balance})
    return LedgerResult(entry, True)


def account_charge(*, organization_id: int, project_id: int | None, amount: int, idempotency_key: str,
                   actor=None, reason: str = "") -> LedgerResult:
    """Debit ``amount`` from the balance with no run and no reservation (a ``charge`` entry with
    source ``direct``), exactly once per ``(organization, key)``.

    ``InsufficientCredits`` (nothing written) when fewer credits are available. A repeat with
    the same key returns the first entry and changes nothing, whatever the balance is now.
    """
    amount = _validate_amount(amount)
    if not isinstance(idempotency_key, str) or not idempotency_key.strip():
        raise ValidationFailed("an idempotency key is required", errors={"idempotency_key": ["must not be empty"]})
    with transaction.atomic():
        account = _account_locked(organization_id)
        existing = _existing(organization_id=organization_id, run_id=None, kind=LedgerEntry.Kind.CHARGE,
                             key=idempotency_key)
        if existing is not None:
            return LedgerResult(existing, False)
        if account.available < amount:
            raise InsufficientCredits(
                f"organization {organization_id} has {account.available} credits available; {amount} needed",
                available=account.available, required=amount,
            )
        account.balance -= amount
        entry = _append(account=account, kind=LedgerEntry.Kind.CHARGE, amount=amount, key=idempotency_key,
                        run_id=None, attempt_number=None, project_id=project_id, source=LedgerEntry.Source.DIRECT,
                        actor=actor, reason=reason)
        return LedgerResult(entry, True)


def _run_entry(*, kind: str, organization_id: int, project_id: int | None, run_id: int, attempt_number: int,
               amount: int, idempotency_key: str, actor, reason: str, apply, source: str = "",
               emit: EventSink | None = None, new: bool = False) -> LedgerResult:
    """Append one run entry exactly once: lock the account, return the entry already written
    under ``(run, kind, key)``, or let ``apply`` move the figures (or refuse) and append.
    ``new``: the caller knows no entry has this key yet (it holds the lock every writer of the
    run's entries of this kind holds, and what it settles is not settled yet): no lookup; a
    duplicate still fails on the unique key.

    In the caller's transaction when there is one (no savepoint: a refusal raises before anything
    is written, so the caller may catch it and go on), else in its own."""
    with transaction.atomic() if not connection.in_atomic_block else nullcontext():
        account = _account_locked(organization_id)
        existing = None if new else _existing(organization_id=organization_id, run_id=run_id, kind=kind,
                                              key=idempotency_key)
        if existing is not None:
            return LedgerResult(existing, False)
        apply(account)
        entry = _append(account=account, kind=kind, amount=amount, key=idempotency_key, run_id=run_id,
                        attempt_number=attempt_number, project_id=project_id, source=source, actor=actor,
                        reason=reason, emit=emit)
        return LedgerResult(entry, True)


def ledger_reserve(*, organization_id: int, project_id: int | None, run_id: int, attempt_number: int,
                   amount: int, idempotency_key: str, actor=None, reason: str = "",
                   emit: EventSink | None = None, new: bool = False) -> LedgerResult:
    """Hold ``amount`` credits for a run attempt; ``InsufficientCredits`` if not available (``new``:
    as ``_run_entry``'s)."""
    amount = _validate_amount(amount)

    def apply(account: CreditAccount) -> None:
        if account.available < amount:
            raise InsufficientCredits(
                f"organization {organization_id} has {account.available} credits available; {amount} needed",
                available=account.available, required=amount,
            )
        account.reserved += amount

    return _run_entry(kind=LedgerEntry.Kind.RESERVE, organization_id=organization_id, project_id=project_id,
                      run_id=run_id, attempt_number=attempt_number, amount=amount, idempotency_key=idempotency_key,
                      actor=actor, reason=reason, apply=apply, emit=emit, new=new)


def ledger_charge(*, organization_id: int, project_id: int | None, run_id: int, attempt_number: int,
                  amount: int, idempotency_key: str, actor=None, reason: str = "",
                  emit: EventSink | None = None, new: bool = False) -> LedgerResult:
    """Consume ``amount`` held credits. The caller checks the attempt's own reservation (``new``:
    as ``_run_entry``'s)."""
    amount = _validate_amount(amount)

    def apply(account: CreditAccount) -> None:
        if account.reserved < amount:
            raise InsufficientCredits(f"organization {organization_id} holds {account.reserved} reserved credits; "
                                      f"cannot charge {amount}")
        account.balance -= amount
        account.reserved -= amount

    return _run_entry(kind=LedgerEntry.Kind.CHARGE, organization_id=organization_id, project_id=project_id,
                      run_id=run_id, attempt_number=attempt_number, amount=amount, idempotency_key=idempotency_key,
                      actor=actor, reason=reason, apply=apply, emit=emit, new=new)


def ledger_refund(*, organization_id: int, project_id: int | None, run_id: int, attempt_number: int,
                  amount: int, source: str, idempotency_key: str, actor=None, reason: str = "",
                  emit: EventSink | None = None) -> LedgerResult:
    """Release an unused hold (``source="reservation"``) or give charged credits back (``"charge"``)."""
    amount = _validate_amount(amount)
    if source not in (LedgerEntry.Source.RESERVATION, LedgerEntry.Source.CHARGE):
        raise ValidationFailed("unknown refund source", errors={"source": [f"{source!r} is not a refund source"]})

    def apply(account: CreditAccount) -> None:
        if source == LedgerEntry.Source.CHARGE:
            account.balance += amount
            return
        if account.reserved < amount:
            raise ValidationFailed(f"cannot release {amount}: only {account.reserved} reserved",
                                   errors={"amount": ["more than is reserved"]})
        account.reserved -= amount

    return _run_entry(kind=LedgerEntry.Kind.REFUND, organization_id=organization_id, project_id=project_id,
                      run_id=run_id, attempt_number=attempt_number, amount=amount, idempotency_key=idempotency_key,
                      actor=actor, reason=reason, apply=apply, source=source, emit=emit)


@transaction.atomic
def organization_create(*, name: str, owner_username: str, staff: bool = False, credits: int = 0, actor=None):
    """Onboard a tenant: the organization, its credit account, a ``default`` project, its owner.

    The owner user is created when missing (with no usable password) and made a member.
    Returns ``(organization, project, owner, owner_created)``.
    """
    name = (name or "").strip()
    owner_username = (owner_username or "").strip()
    errors: dict[str, list[str]] = {}
    if not name:
        errors["name"] = ["must not be empty"]
    elif Organization.objects.filter(name=name).exists():
        errors["name"] = [f"organization {name!r} already exists"]
    if not owner_username:
        errors["owner"] = ["must not be empty"]
    if isinstance(credits, bool) or not isinstance(credits, int) or credits < 0:
        errors["credits"] = ["must be a whole number, zero or more"]
    if errors:
        raise ValidationFailed("invalid organization", errors=errors)
    User = get_user_model()
    owner, owner_created = User.objects.get_or_create(username=owner_username)
    if owner_created:
        owner.set_unusable_password()
    if staff:
        owner.is_staff = True
    owner.save()
    organization = Organization.objects.create(name=name)
    Membership.objects.create(organization=organization, user=owner, role=Membership.Role.OWNER)
    project = Project.objects.create(organization=organization, name="default")
    account_open(organization=organization)
    event_record(type=ORGANIZATION_CREATED, organization_id=organization.pk,
                 payload={"organization": organization.pk, "name": name, "project": project.pk})
    audit_record(actor=actor, action="organization_create", target_type="organization", target_id=organization.pk,
                 organization_id=organization.pk, after={"name": name, "owner": owner_username, "project": project.pk})
    if credits:
        account_topup(organization_id=organization.pk, amount=credits, reason="initial credits", actor=actor,
                      idempotency_key="initial")
    return organization, project, owner, owner_created
