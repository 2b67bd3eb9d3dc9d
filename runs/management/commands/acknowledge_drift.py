"""``acknowledge_drift RUN [RUN ...] --reason TEXT [--dimension D] [--dry-run] [--as USERNAME] [--json]``."""

from core.management.base import RunbookActionCommand
from runs.models import Run
from runs.runbooks import RUN_ACKNOWLEDGE_DRIFT


class Command(RunbookActionCommand):
    help = ("Acknowledge the drift runs stopped on (stopped_drift:<dimension>): a pin's live value becomes the pin, "
            "the old one stays in the record. The runs stay paused: resume them with resume_run.")
    runbook = RUN_ACKNOWLEDGE_DRIFT
    model = Run
    noun = "run"

    def add_runbook_arguments(self, parser):
        parser.add_argument("--dimension", default="", help="acknowledge this dimension only (default: all)")

    def runbook_options(self, options):
        return {"dimension": (options["dimension"] or "").strip()}
