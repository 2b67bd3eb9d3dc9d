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
from core.fsm import moves_flush_of, moves_may_wait, save_moved_together
from core.models import Membership, Organization, Project
from core.services import actor_label, audit_record, event_record, transition_log
from core.sql import ModelRows, db, db_values, hot_cursor, per_vendor


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
    with hot_cursor() as cursor:  # one prepared statement: every charge of a step takes this lock
        cursor.execute(_account_locked_sql(), [organization_id])
        row = cursor.fetchone()
    if row is not None:
        return _ACCOUNT_ROWS.load(row)
    try:
        return CreditAccount.objects.select_for_update().get(organization_id=organization_id)
    except CreditAccount.DoesNotExist as exc:
        if not Organization.objects.filter(pk=organization_id).exists():
            raise NotFound(f"organization {organization_id} does not exist") from exc
        # An organization created outside the onboarding service: open its account now.
        CreditAccount.objects.get_or_create(organization_id=organization_id)
        return CreditAccount.objects.select_for_update().get(organization_id=organization_id)


def _account_locked_with_keys(organization_id: int, entries: list) -> tuple[CreditAccount, dict[tuple, int]]:
    """The organization's account, locked, and the ids of the entries already written under the
    ``(run, kind, key)`` of ``entries`` (those found), read in the statement that locks the account.

    On PostgreSQL a statement that waited for the row lock returns the account as the writer it
    waited for left it, but reads other rows (the entries) as they were when it began: it also reads
    the account's last entry hash as it was then, and when that is not the one it locked (an entry
    was appended meanwhile) the keys are read again, after the lock. (On SQLite the transaction holds
    the database's write lock from its first statement: nothing is appended meanwhile.)"""
    keys = list(dict.fromkeys((entry.run_id, entry.kind, entry.idempotency_key) for entry in entries))
    if keys:
        with hot_cursor() as cursor:
            cursor.execute(_account_with_keys_sql(len(keys)),
                           [value for key in keys for value in key] + [organization_id])
            row = cursor.fetchone()
        if row is not None:
            account, seen = _ACCOUNT_ROWS.load(row), row[_ACCOUNT_ROWS.width]
            if seen == account.last_entry_hash:
                return account, {key: entry_id for key, entry_id in zip(keys, row[_ACCOUNT_ROWS.width + 1:])
                                 if entry_id is not None}
    account = _account_locked(organization_id)
    found = {}
    for run_id, kind, key in keys:
        entry = _existing(organization_id=organization_id, run_id=run_id, kind=kind, key=key)
        if entry is not None:
            found[(run_id, kind, key)] = entry.pk
    return account, found


_ACCOUNT_ROWS = ModelRows(CreditAccount)


@per_vendor
def _account_locked_sql() -> str:
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    return (f"SELECT {_ACCOUNT_ROWS.columns('c')} FROM {connection.ops.quote_name(CreditAccount._meta.db_table)} c"
            f" WHERE c.organization_id = %s{lock}")


@per_vendor
def _account_with_keys_sql(count: int) -> str:
    """The account of an organization, locked, its last entry hash as the statement's snapshot has
    it, and per ``(run, kind, key)`` the id of its entry (or NULL)."""
    qn = connection.ops.quote_name
    table = qn(CreditAccount._meta.db_table)
    lookup = (f"(SELECT e.id FROM {qn(LedgerEntry._meta.db_table)} e"
              " WHERE e.run_id = %s AND e.kind = %s AND e.idempotency_key = %s)")
    lock = " FOR UPDATE OF c" if connection.features.has_select_for_update_of else ""
    return (f"SELECT {_ACCOUNT_ROWS.columns('c')}, (SELECT s.last_entry_hash FROM {table} s WHERE s.id = c.id),"
            f" {', '.join([lookup] * count)} FROM {table} c WHERE c.organization_id = %s{lock}")


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
    """Append an entry for movements already applied to ``account`` (locked), then save both."""
    entry = _entry_row(account, kind=kind, amount=amount, key=key, run_id=run_id, attempt_number=attempt_number,
                       source=source, actor=actor, reason=reason)
    _entries_save(account, [entry])
    _entry_emitted(entry, balance=account.balance, reserved=account.reserved, project_id=project_id, emit=emit)
    return entry


def _entry_row(account: CreditAccount, *, kind: str, amount: int, key: str, run_id: int | None,
               attempt_number: int | None, source: str, actor, reason: str) -> LedgerEntry:
    """The entry for movements just applied to ``account`` (locked), chained to its last entry
    (which it becomes): not saved yet."""
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
    account.last_entry_hash = entry.entry_hash
    return entry


def _entries_save(account: CreditAccount, entries: list[LedgerEntry]) -> None:
    """Insert new entries (one statement) and save the account they leave.

    The entries' keys were looked up under the account's row lock, which every writer of the
    organization's entries holds, so no concurrent writer can insert the same key: no savepoint.
    A duplicate written around the services still fails (``ValidationFailed``) and, being a
    failed statement, fails the caller's transaction with it."""
    try:
        if connection.vendor == "postgresql":
            _entries_save_together(account, entries)
            return
        if len(entries) == 1:
            entries[0].save()
        else:
            LedgerEntry.objects.bulk_create(entries)
    except IntegrityError as exc:  # a concurrent writer used the same key first
        keys = ", ".join(repr(entry.idempotency_key) for entry in entries)
        kinds = ", ".join(sorted({entry.kind for entry in entries}))
        raise ValidationFailed(f"ledger key {keys} already used for {kinds}",
                               errors={"idempotency_key": ["already used"]}) from exc
    account.updated_at = timezone.now()  # inside a run service's batch, written with its other rows
    save_moved_together([(account, _ACCOUNT_SAVED_NAMES)], put_off=True)


def _entries_save_together(account: CreditAccount, entries: list[LedgerEntry]) -> None:
    """``_entries_save`` on PostgreSQL: the entries' INSERT and the account's UPDATE in one prepared
    statement (a data-modifying ``WITH``), which fails as a whole on a duplicate key."""
    account.updated_at = timezone.now()
    conn = db()
    params = [value for entry in entries
              for value in db_values(_ENTRY_FIELDS, [getattr(entry, field.attname) for field in _ENTRY_FIELDS], conn)]
    params += db_values(_ACCOUNT_SAVED, [getattr(account, field.attname) for field in _ACCOUNT_SAVED], conn)
    params.append(account.pk)
    with hot_cursor() as cursor:
        cursor.execute(_entries_save_sql(len(entries)), params)
        ids = sorted(row[0] for row in cursor.fetchall())  # ids increase in the order of the rows
    for entry, entry_id in zip(entries, ids, strict=True):
        entry.pk = entry_id
        entry._state.adding, entry._state.db = False, connection.alias


_ENTRY_FIELDS = [field for field in LedgerEntry._meta.concrete_fields if not field.primary_key]
_ACCOUNT_SAVED_NAMES = ("balance", "reserved", "last_entry_hash", "updated_at")
_ACCOUNT_SAVED = [CreditAccount._meta.get_field(name) for name in _ACCOUNT_SAVED_NAMES]


@per_vendor
def _entries_save_sql(count: int) -> str:
    qn = connection.ops.quote_name
    row = f"({', '.join(['%s'] * len(_ENTRY_FIELDS))})"
    sets = ", ".join(f"{qn(field.column)} = %s" for field in _ACCOUNT_SAVED)
    return (f"WITH e AS (INSERT INTO {qn(LedgerEntry._meta.db_table)}"
            f" ({', '.join(qn(field.column) for field in _ENTRY_FIELDS)}) VALUES {', '.join([row] * count)}"
            f" RETURNING id), a AS (UPDATE {qn(CreditAccount._meta.db_table)} SET {sets} WHERE id = %s)"
            " SELECT id FROM e")


def _entry_emitted(entry: LedgerEntry, *, balance: int, reserved: int, project_id: int | None,
                   emit: EventSink | None) -> None:
    """The entry's event (the account's figures just after it) and its transition line."""
    (emit or event_record)(
        type=ledger_event(entry.kind),
        organization_id=entry.organization_id,
        project_id=project_id,
        run_id=entry.run_id,
        payload={"entry": entry.pk, "kind": entry.kind, "source": entry.source, "amount": entry.amount,
                 "attempt": entry.attempt_number, "balance": balance, "reserved": reserved,
                 "available": balance - reserved},
    )
    transition_log(entity="ledger", id=entry.pk, kind=entry.kind, amount=entry.amount, run=entry.run_id,
                   attempt=entry.attempt_number, organization=entry.organization_id, key=entry.idempotency_key)


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


@dataclass
class RunEntry:
    """A run entry to append (``ledger_run_entries``): what it records, and ``apply``, which moves
    the locked account's figures for it or refuses (raises) before anything is written. ``new``: the
    caller knows no entry has this key yet (it holds the lock every writer of the run's entries of
    this kind holds, and what it settles is not settled yet): no lookup; a duplicate still fails on
    the unique key. Built by ``ledger_reserve_entry``, ``ledger_charge_entry``, ``ledger_refund_entry``."""

    kind: str
    project_id: int | None
    run_id: int
    attempt_number: int
    amount: int
    idempotency_key: str
    apply: Callable[[CreditAccount], None]
    source: str = ""
    actor: Any = None
    reason: str = ""
    emit: EventSink | None = None
    new: bool = False


def ledger_run_entries(*, organization_id: int, entries: list[RunEntry]) -> list[LedgerResult]:
    """Append run entries of one organization in order, each exactly once, under one lock of its
    account: an entry already written under ``(run, kind, key)`` (or earlier in ``entries``) is
    returned as it is, the others move the figures and are inserted together, chained in order,
    with one update of the account; their events are emitted in order. The result is what appending
    each alone, in order, would give: an entry that refuses raises with the entries before it written
    and nothing of its own.

    In the caller's transaction when there is one (no savepoint: a refusal raises before anything
    of its own is written, so the caller may catch it and go on), else in its own. It touches the
    billing tables only: row moves a run service keeps (``core.fsm.moves_put_off``) wait past it."""
    moves_flush_of(CreditAccount)  # an update of the account kept (SQLite) goes before its read
    with transaction.atomic() if not connection.in_atomic_block else nullcontext(), moves_may_wait():
        account, found = _account_locked_with_keys(organization_id, [entry for entry in entries if not entry.new])
        results: list[LedgerResult | int] = []
        appended: list[tuple[RunEntry, LedgerEntry, int, int]] = []
        for entry in entries:
            key = (entry.run_id, entry.kind, entry.idempotency_key)
            existing = found.get(key)
            if existing is not None:
                results.append(existing if isinstance(existing, int) else LedgerResult(existing, False))
                continue
            try:
                entry.apply(account)
            except Exception:  # refused: the entries before it are written, as if each were appended alone
                _entries_append(account, appended)
                raise
            row = _entry_row(account, kind=entry.kind, amount=entry.amount, key=entry.idempotency_key,
                             run_id=entry.run_id, attempt_number=entry.attempt_number, source=entry.source,
                             actor=entry.actor, reason=entry.reason)
            appended.append((entry, row, account.balance, account.reserved))
            results.append(LedgerResult(row, True))
            found[key] = row
        _entries_append(account, appended)
        if any(isinstance(result, int) for result in results):
            rows = LedgerEntry.objects.in_bulk([result for result in results if isinstance(result, int)])
            results = [LedgerResult(rows[result], False) if isinstance(result, int) else result for result in results]
        return results


def _entries_append(account: CreditAccount, appended: list[tuple[RunEntry, LedgerEntry, int, int]]) -> None:
    """Save the entries (with the account's figures just after each) and emit their events, in order."""
    if not appended:
        return
    _entries_save(account, [row for _, row, _, _ in appended])
    for entry, row, balance, reserved in appended:
        _entry_emitted(row, balance=balance, reserved=reserved, project_id=entry.project_id, emit=entry.emit)


def _run_entry(entry: RunEntry, *, organization_id: int) -> LedgerResult:
    return ledger_run_entries(organization_id=organization_id, entries=[entry])[0]


def ledger_reserve(*, organization_id: int, project_id: int | None, run_id: int, attempt_number: int,
                   amount: int, idempotency_key: str, actor=None, reason: str = "",
                   emit: EventSink | None = None, new: bool = False) -> LedgerResult:
    """Hold ``amount`` credits for a run attempt; ``InsufficientCredits`` if not available (``new``:
    as ``RunEntry``'s)."""
    return _run_entry(ledger_reserve_entry(
        organization_id=organization_id, project_id=project_id, run_id=run_id, attempt_number=attempt_number,
        amount=amount, idempotency_key=idempotency_key, actor=actor, reason=reason, emit=emit, new=new),
        organization_id=organization_id)


def ledger_reserve_entry(*, organization_id: int, project_id: int | None, run_id: int, attempt_number: int,
                         amount: int, idempotency_key: str, actor=None, reason: str = "",
                         emit: EventSink | None = None, new: bool = False) -> RunEntry:
    """``ledger_reserve``'s entry, for ``ledger_run_entries``."""
    amount = _validate_amount(amount)

    def apply(account: CreditAccount) -> None:
        if account.available < amount:
            raise InsufficientCredits(
                f"organization {organization_id} has {account.available} credits available; {amount} needed",
                available=account.available, required=amount,
            )
        account.reserved += amount

    return RunEntry(kind=LedgerEntry.Kind.RESERVE, project_id=project_id, run_id=run_id,
                    attempt_number=attempt_number, amount=amount, idempotency_key=idempotency_key, actor=actor,
                    reason=reason, apply=apply, emit=emit, new=new)


def ledger_charge(*, organization_id: int, project_id: int | None, run_id: int, attempt_number: int,
                  amount: int, idempotency_key: str, actor=None, reason: str = "",
                  emit: EventSink | None = None, new: bool = False) -> LedgerResult:
    """Consume ``amount`` held credits. The caller checks the attempt's own reservation (``new``:
    as ``RunEntry``'s)."""
    return _run_entry(ledger_charge_entry(
        organization_id=organization_id, project_id=project_id, run_id=run_id, attempt_number=attempt_number,
        amount=amount, idempotency_key=idempotency_key, actor=actor, reason=reason, emit=emit, new=new),
        organization_id=organization_id)


def ledger_charge_entry(*, organization_id: int, project_id: int | None, run_id: int, attempt_number: int,
                        amount: int, idempotency_key: str, actor=None, reason: str = "",
                        emit: EventSink | None = None, new: bool = False) -> RunEntry:
    """``ledger_charge``'s entry, for ``ledger_run_entries``."""
    amount = _validate_amount(amount)

    def apply(account: CreditAccount) -> None:
        if account.reserved < amount:
            raise InsufficientCredits(f"organization {organization_id} holds {account.reserved} reserved credits; "
                                      f"cannot charge {amount}")
        account.balance -= amount
        account.reserved -= amount

    return RunEntry(kind=LedgerEntry.Kind.CHARGE, project_id=project_id, run_id=run_id,
                    attempt_number=attempt_number, amount=amount, idempotency_key=idempotency_key, actor=actor,
                    reason=reason, apply=apply, emit=emit, new=new)


def ledger_refund(*, organization_id: int, project_id: int | None, run_id: int, attempt_number: int,
                  amount: int, source: str, idempotency_key: str, actor=None, reason: str = "",
                  emit: EventSink | None = None) -> LedgerResult:
    """Release an unused hold (``source="reservation"``) or give charged credits back (``"charge"``)."""
    return _run_entry(ledger_refund_entry(
        organization_id=organization_id, project_id=project_id, run_id=run_id, attempt_number=attempt_number,
        amount=amount, source=source, idempotency_key=idempotency_key, actor=actor, reason=reason, emit=emit),
        organization_id=organization_id)


def ledger_refund_entry(*, organization_id: int, project_id: int | None, run_id: int, attempt_number: int,
                        amount: int, source: str, idempotency_key: str, actor=None, reason: str = "",
                        emit: EventSink | None = None) -> RunEntry:
    """``ledger_refund``'s entry, for ``ledger_run_entries``."""
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

    return RunEntry(kind=LedgerEntry.Kind.REFUND, project_id=project_id, run_id=run_id,
                    attempt_number=attempt_number, amount=amount, idempotency_key=idempotency_key, actor=actor,
                    reason=reason, apply=apply, source=source, emit=emit)


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
