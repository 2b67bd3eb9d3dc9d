"""Reads of credits: balances and ledger sums."""

from __future__ import annotations

from django.db import connection
from django.db.models import Case, F, Sum, When, Value, BigIntegerField, Q

from billing.models import CreditAccount, LedgerEntry


def account_balance(*, organization_id: int) -> dict:
    account = CreditAccount.objects.filter(organization_id=organization_id).first()
    if account is None:
        return {"organization": organization_id, "balance": 0, "reserved": 0, "available": 0}
    return {"organization": organization_id, "balance": account.balance, "reserved": account.reserved,
            "available": account.available}


def account_available_sql() -> str:
    """``account_balance``'s ``available`` (NULL without an account) as an SQL expression whose one
    parameter is the organization's id, for a statement that reads it with rows of its own."""
    qn = connection.ops.quote_name
    return (f"(SELECT c.balance - c.reserved FROM {qn(CreditAccount._meta.db_table)} c"
            " WHERE c.organization_id = %s)")


def ledger_totals(*, run_id: int, attempt_number: int | None = None) -> dict[str, int]:
    """Reserved, charged (net of charge refunds) and refunded credits of a run or one attempt."""
    queryset = LedgerEntry.objects.filter(run_id=run_id)
    if attempt_number is not None:
        queryset = queryset.filter(attempt_number=attempt_number)
    sums = queryset.aggregate(
        reserved=Sum("amount", filter=Q(kind=LedgerEntry.Kind.RESERVE)),
        charged=Sum("amount", filter=Q(kind=LedgerEntry.Kind.CHARGE)),
        refunded=Sum("amount", filter=Q(kind=LedgerEntry.Kind.REFUND)),
        charge_refunds=Sum("amount", filter=Q(kind=LedgerEntry.Kind.REFUND, source=LedgerEntry.Source.CHARGE)),
    )
    reserved = sums["reserved"] or 0
    charged = (sums["charged"] or 0) - (sums["charge_refunds"] or 0)
    return {"reserved": reserved, "charged": charged, "refunded": sums["refunded"] or 0}


def ledger_account_sums(*, organization_id: int) -> dict[str, int]:
    """Balance and reserved amount implied by an organization's ledger entries (a direct charge
    debits the balance only)."""
    signed_balance = Case(
        When(kind=LedgerEntry.Kind.TOPUP, then=F("amount")),
        When(kind=LedgerEntry.Kind.CHARGE, then=-F("amount")),
        When(kind=LedgerEntry.Kind.REFUND, source=LedgerEntry.Source.CHARGE, then=F("amount")),
        default=Value(0),
        output_field=BigIntegerField(),
    )
    signed_reserved = Case(
        When(kind=LedgerEntry.Kind.RESERVE, then=F("amount")),
        When(kind=LedgerEntry.Kind.CHARGE, source=LedgerEntry.Source.DIRECT, then=Value(0)),
        When(kind=LedgerEntry.Kind.CHARGE, then=-F("amount")),
        When(kind=LedgerEntry.Kind.REFUND, source=LedgerEntry.Source.RESERVATION, then=-F("amount")),
        default=Value(0),
        output_field=BigIntegerField(),
    )
    sums = LedgerEntry.objects.filter(organization_id=organization_id).aggregate(
        balance=Sum(signed_balance), reserved=Sum(signed_reserved)
    )
    return {"balance": sums["balance"] or 0, "reserved": sums["reserved"] or 0}


def direct_charge_exists(*, organization_id: int, idempotency_key: str) -> bool:
    """Whether a direct charge (no run) was already written under ``idempotency_key``."""
    return LedgerEntry.objects.filter(organization_id=organization_id, run__isnull=True,
                                      kind=LedgerEntry.Kind.CHARGE, idempotency_key=idempotency_key).exists()
