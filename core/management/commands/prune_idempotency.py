"""Delete expired Idempotency-Key records: ``prune_idempotency`` (run it daily)."""

from core.api.idempotency import idempotency_prune
from core.management.base import RunbookCommand


class Command(RunbookCommand):
    help = "Delete Idempotency-Key records past their 24 h expiry; prints how many were deleted."

    def handle(self, *args, **options):
        deleted = idempotency_prune()
        self.stdout.write(f"deleted {deleted} expired idempotency record(s)")
