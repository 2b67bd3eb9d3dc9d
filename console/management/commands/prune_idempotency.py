"""Delete expired Idempotency-Key records: ``prune_idempotency`` (the ``idempotency`` step of ``prune``)."""

from core.management.base import RunbookCommand
from console.retention import retention_prune


class Command(RunbookCommand):
    help = ("Delete Idempotency-Key records past their 24 h expiry; prints how many were deleted. "
            "Same as `prune --only idempotency` (which the retention schedule runs every 10 minutes).")

    def handle(self, *args, **options):
        (result,) = retention_prune(only=["idempotency"])
        self.stdout.write(f"deleted {result.done} expired idempotency record(s)")
