"""``escalate_run RUN [RUN ...] --reason TEXT [--severity S] [--dry-run] [--as USERNAME] [--json]``."""

from core.management.base import RunbookActionCommand
from runs.models import Run
from runs.runbooks import RUN_ESCALATE


class Command(RunbookActionCommand):
    help = "Open a manual escalation ticket for runs (the reason is the ticket's detail); one open ticket per run."
    runbook = RUN_ESCALATE
    model = Run
    noun = "run"

    def add_runbook_arguments(self, parser):
        parser.add_argument("--severity", choices=["critical", "high", "medium", "low"], default="high")

    def runbook_options(self, options):
        return {"severity": options["severity"]}
