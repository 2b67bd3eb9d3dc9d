"""``pause_run RUN [RUN ...] --reason TEXT [--dry-run] [--as USERNAME] [--json]``."""

from core.management.base import RunbookActionCommand
from runs.models import Run
from runs.runbooks import RUN_PAUSE


class Command(RunbookActionCommand):
    help = "Pause running runs: no new work starts until they are resumed (credits stay reserved)."
    runbook = RUN_PAUSE
    model = Run
    noun = "run"
