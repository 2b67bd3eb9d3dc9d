"""Credit accounts and the append-only ledger.

Money moves only by appending ``LedgerEntry`` rows; ``CreditAccount`` keeps the running
``balance`` and ``reserved`` figures that the entries imply, so ``available = balance -
reserved`` is one row read. Entries are never updated or deleted: the model layer refuses it
everywhere and a PostgreSQL trigger refuses it in the database. Each entry also carries a
hash chained to the organization's previous entry, so ``check_invariants`` detects a row
changed behind our back.
"""

from __future__ import annotations

import hashlib
import json

from django.conf import settings
from django.db import models

from core.models import Organization


class AppendOnlyViolation(Exception):
    """Raised when code tries to change or delete a ledger entry."""


class CreditAccount(models.Model):
    """An organization's credits: ``balance`` (what it owns) and ``reserved`` (held for runs)."""

    organization = models.OneToOneField(Organization, on_delete=models.PROTECT, related_name="credit_account")
    balance = models.BigIntegerField(default=0)
    reserved = models.BigIntegerField(default=0)
    last_entry_hash = models.CharField(max_length=64, blank=True, default="")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=models.Q(reserved__gte=0), name="account_reserved_not_negative"),
            models.CheckConstraint(condition=models.Q(balance__gte=models.F("reserved")),
                                   name="account_available_not_negative"),
        ]
        permissions = [("refund_run", "Can refund credits of a run"),
                       ("topup_credits", "Can add credits to an organization")]

    def __str__(self) -> str:
        return f"{self.organization.name}: {self.balance} ({self.reserved} reserved)"

    @property
    def available(self) -> int:
        return self.balance - self.reserved


class LedgerEntryQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise AppendOnlyViolation("ledger entries are append-only: UPDATE is not allowed")

    def delete(self, *args, **kwargs):  # also stands in for _raw_delete(using)
        raise AppendOnlyViolation("ledger entries are append-only: DELETE is not allowed")

    _raw_delete = delete


class LedgerEntry(models.Model):
    """One movement of credits. Append-only; ``amount`` is always positive.

    Effects on the account: ``topup`` adds to the balance; ``reserve`` holds credits for a
    run attempt; ``charge`` consumes held credits (balance and reserved both drop);
    ``refund`` with source ``reservation`` releases an unused hold, with source ``charge``
    gives charged credits back to the balance. For a run attempt, at every moment
    ``reserved >= charged >= 0`` (charged net of charge refunds) and on a terminal state
    ``charged + refunded = reserved``.
    """

    class Kind(models.TextChoices):
        TOPUP = "topup", "Top-up"
        RESERVE = "reserve", "Reserve"
        CHARGE = "charge", "Charge"
        REFUND = "refund", "Refund"

    class Source(models.TextChoices):
        NONE = "", "—"
        RESERVATION = "reservation", "Unused reservation"
        CHARGE = "charge", "Charged credits"

    id = models.BigAutoField(primary_key=True)
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="ledger_entries")
    run = models.ForeignKey("runs.Run", null=True, blank=True, on_delete=models.PROTECT,
                            related_name="ledger_entries")
    attempt_number = models.PositiveIntegerField(null=True, blank=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    source = models.CharField(max_length=16, choices=Source.choices, blank=True, default="")
    amount = models.BigIntegerField()
    idempotency_key = models.CharField(max_length=200)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                              related_name="+")
    actor_label = models.CharField(max_length=150, default="system")
    reason = models.TextField(blank=True)
    balance_after = models.BigIntegerField()
    reserved_after = models.BigIntegerField()
    prev_hash = models.CharField(max_length=64, blank=True)
    entry_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField()

    objects = LedgerEntryQuerySet.as_manager()

    class Meta:
        ordering = ["id"]
        verbose_name_plural = "ledger entries"
        constraints = [
            models.CheckConstraint(condition=models.Q(amount__gt=0), name="ledger_amount_positive"),
            models.UniqueConstraint(fields=["run", "kind", "idempotency_key"],
                                    condition=models.Q(run__isnull=False), name="ledger_unique_key_per_run_kind"),
            models.UniqueConstraint(fields=["organization", "kind", "idempotency_key"],
                                    condition=models.Q(run__isnull=True), name="ledger_unique_key_per_org_kind"),
        ]
        indexes = [
            models.Index(fields=["run", "attempt_number", "kind"], name="ledger_run_attempt_idx"),
            models.Index(fields=["organization", "id"], name="ledger_org_id_idx"),
            # The ledger list (newest first) filtered by kind: an index seek.
            models.Index(fields=["kind", "id"], name="ledger_kind_id_idx"),
        ]

    def __str__(self) -> str:
        return f"#{self.id} {self.kind} {self.amount}"

    def save(self, *args, **kwargs):
        if not self._state.adding:
            raise AppendOnlyViolation("ledger entries are append-only: an existing entry cannot be saved")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise AppendOnlyViolation("ledger entries are append-only: an entry cannot be deleted")

    def compute_hash(self) -> str:
        """SHA-256 over the entry's content and the previous entry's hash."""
        body = json.dumps(
            {
                "prev": self.prev_hash,
                "organization": self.organization_id,
                "run": self.run_id,
                "attempt": self.attempt_number,
                "kind": self.kind,
                "source": self.source,
                "amount": int(self.amount),
                "key": self.idempotency_key,
                "balance_after": int(self.balance_after),
                "reserved_after": int(self.reserved_after),
                "created_at": self.created_at.isoformat(),
            },
            sort_keys=True,
        )
        return hashlib.sha256(body.encode()).hexdigest()
