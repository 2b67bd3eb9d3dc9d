"""Admin for credits: accounts and the append-only ledger (read-only; nothing can be deleted).

Credits move only through the billing services: top-ups with ``topup_credits``, refunds of
a run with the run admin's refund action or ``refund_run``."""

from django.contrib import admin

from billing.models import CreditAccount, LedgerEntry
from core.admin import ReadOnlyAdmin
from core.admin_runbooks import recent_filter
from core.admin_scale import ScaledListMixin


@admin.register(CreditAccount)
class CreditAccountAdmin(ReadOnlyAdmin):
    list_display = ("organization", "balance", "reserved", "available", "updated_at")
    list_select_related = ("organization",)
    search_fields = ("organization__name",)


@admin.register(LedgerEntry)
class LedgerEntryAdmin(ScaledListMixin, ReadOnlyAdmin):
    list_display = ("id", "created_at", "organization", "run_id", "attempt_number", "kind", "source", "amount",
                    "balance_after", "reserved_after", "actor_label", "idempotency_key")
    list_filter = ("kind", "source", "organization", recent_filter("created_at", "written"),
                   ("created_at", admin.DateFieldListFilter))
    list_select_related = ("organization",)
    search_fields = ("=run__id", "idempotency_key", "organization__name", "reason", "actor_label")
    ordering = ("-id",)  # newest first, read by keyset
