"""``refund_run RUN [RUN ...] --reason TEXT [--amount N] [--key KEY] [--dry-run] [--as USERNAME] [--json]``.

Give charged credits of settled runs back (all of them, or ``--amount`` per run; never more
than charged). With ``--key``, repeating the command refunds once.
"""

from django.core.management.base import CommandError

from core.management.base import RunbookActionCommand
from runs.models import Run
from runs.runbooks import RUN_REFUND


class Command(RunbookActionCommand):
    help = ("Refund charged credits of completed, failed or cancelled runs: everything charged, or --amount "
            "per run (never more than charged minus refunded).")
    runbook = RUN_REFUND
    model = Run
    noun = "run"

    def add_runbook_arguments(self, parser):
        parser.add_argument("--amount", type=int, help="credits per run (default: everything still charged)")
        parser.add_argument("--key", help="idempotency key: repeating the command with it refunds once")

    def runbook_options(self, options):
        if options["amount"] is not None and options["amount"] <= 0:
            raise CommandError("--amount must be a whole number greater than zero")
        key = (options["key"] or "").strip()
        return {"amount": options["amount"], "key": f"cli:{key}" if key else None}
