"""Credit accounts and the append-only ledger.

Money moves only by appending ``LedgerEntry`` rows; ``CreditAccount`` keeps the running
``balance`` and ``reserved`` figures that the entries imply, so ``available = balance -
reserved`` is one row read. Entries are never updated or deleted: the model layer refuses it
everywhere, and triggers refuse it in the database (UPDATE, DELETE and TRUNCATE on PostgreSQL,
UPDATE and DELETE on SQLite). Each entry also carries a keyed hash (HMAC-SHA256, see
``billing.chain``) chained to the organization's previous entry, so ``check_invariants``
detects a row changed behind our back, even when the chain after it was recomputed.
"""

from __future__ import annotations

import json

from django.conf import settings
from django.db import models, router

from billing.chain import entry_digest, legacy_entry_digest
from billing.errors import AppendOnlyViolation
from core.models import Organization


class CreditAccount(models.Model):
    """An organization's credits: ``balance`` (what it owns) and ``reserved`` (held for runs)."""

    organization = models.OneToOneField(Organization, on_delete=models.PROTECT, related_name="credit_account")
    balance = models.BigIntegerField(default=0)
    reserved = models.BigIntegerField(default=0)
    last_entry_hash = models.CharField(max_length=64, blank=True, default="")
    # Entries up to this id were hashed before the chain was keyed; the seal (keyed) fixes the boundary.
    legacy_chain_end = models.BigIntegerField(null=True, blank=True)
    legacy_chain_seal = models.CharField(max_length=64, blank=True, default="")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=models.Q(reserved__gte=0), name="account_reserved_not_negative"),
            models.CheckConstraint(condition=models.Q(balance__gte=models.F("reserved")),
                                   name="account_available_not_negative"),
        ]
        # refund_run is declared by the refund runbook (runs.runbooks)
        permissions = [("topup_credits", "Can add credits to an organization")]

    def __str__(self) -> str:
        return f"{self.organization.name}: {self.balance} ({self.reserved} reserved)"

    @property
    def available(self) -> int:
        return self.balance - self.reserved


class LedgerEntryQuerySet(models.QuerySet):
    """Refuses every UPDATE and DELETE path of the ORM (it is also the base manager)."""

    def update(self, **kwargs):
        raise AppendOnlyViolation("ledger entries are append-only: UPDATE is not allowed")

    def _update(self, values):  # Model.save's UPDATE of an existing row goes through here
        raise AppendOnlyViolation("ledger entries are append-only: UPDATE is not allowed")

    def delete(self, *args, **kwargs):  # also stands in for _raw_delete(using)
        raise AppendOnlyViolation("ledger entries are append-only: DELETE is not allowed")

    _raw_delete = delete


class LedgerEntry(models.Model):
    """One movement of credits. Append-only; ``amount`` is always positive.

    Effects on the account: ``topup`` adds to the balance; ``reserve`` holds credits for a
    run attempt; ``charge`` of a run consumes held credits (balance and reserved both drop);
    ``charge`` with source ``direct`` (no run: a command job's tool) debits the balance only;
    ``refund`` with source ``reservation`` releases an unused hold, with source ``charge``
    gives charged credits back to the balance. For a run attempt, at every moment
    ``reserved >= charged >= 0`` (charged net of charge refunds) and on a terminal state
    ``charged + refunded = reserved``.
    """

    class Kind(models.TextChoices):
        TOPUP = "topup", "Top-up"
        RESERVE = "reserve"
        CHARGE = "charge"
        REFUND = "refund"

    class Source(models.TextChoices):
        NONE = "", "—"
        RESERVATION = "reservation", "Unused reservation"
        CHARGE = "charge", "Charged credits"
        DIRECT = "direct", "Direct debit"

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
        base_manager_name = "objects"  # Django's internal paths get the guarded queryset too
        constraints = [
            models.CheckConstraint(condition=models.Q(amount__gt=0), name="ledger_amount_positive"),
            models.UniqueConstraint(fields=["run", "kind", "idempotency_key"],
                                    condition=models.Q(run__isnull=False), name="ledger_unique_key_per_run_kind"),
            models.UniqueConstraint(fields=["organization", "kind", "idempotency_key"],
                                    condition=models.Q(run__isnull=True), name="ledger_unique_key_per_org_kind"),
            # A run's charge consumes its reservation; a charge without a run is a direct debit.
            models.CheckConstraint(condition=~models.Q(kind="charge")
                                   | models.Q(run__isnull=False, source="")
                                   | models.Q(run__isnull=True, source="direct"),
                                   name="ledger_charge_source_matches_run"),
        ]
        indexes = [
            models.Index(fields=["run", "attempt_number", "kind"], name="ledger_run_attempt_idx"),
            models.Index(fields=["organization", "id"], name="ledger_org_id_idx"),
            # The ledger list (newest first) filtered by kind: an index seek.
            models.Index(fields=["kind", "id"], name="ledger_kind_id_idx"),
        ]

    def __str__(self) -> str:
        return f"#{self.id} {self.kind} {self.amount}"

    def save(self, *, force_insert=False, force_update=False, using=None, update_fields=None):
        """Insert a new entry; an existing one (loaded, or named by its primary key) is refused."""
        if not self._state.adding or force_update or update_fields is not None:
            raise AppendOnlyViolation("ledger entries are append-only: an existing entry cannot be saved")
        database = using or router.db_for_write(type(self), instance=self)
        if self.pk is not None and type(self)._base_manager.using(database).filter(pk=self.pk).exists():
            raise AppendOnlyViolation(f"ledger entries are append-only: entry {self.pk} exists and cannot be "
                                      f"saved again")
        super().save(force_insert=True, using=using)

    def delete(self, *args, **kwargs):
        raise AppendOnlyViolation("ledger entries are append-only: an entry cannot be deleted")

    def compute_hash(self, *, key: bytes | None = None) -> str:
        """HMAC-SHA256 (the ledger key, or ``key``) over the entry's content and the previous hash."""
        return entry_digest(self.hash_body(), key=key)

    def compute_legacy_hash(self) -> str:
        """The plain SHA-256 digest entries carried before the chain was keyed."""
        return legacy_entry_digest(self.hash_body())

    def hash_body(self) -> bytes:
        """The canonical bytes the entry's hash covers."""
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
        return body.encode()
