"""``retry_run RUN [RUN ...] --reason TEXT [--dry-run] [--as USERNAME] [--json]``."""

from core.management.base import RunbookActionCommand
from runs.models import Run
from runs.runbooks import RUN_RETRY


class Command(RunbookActionCommand):
    help = "Retry failed runs with attempts left: a new attempt with a new reservation of credit_limit credits."
    runbook = RUN_RETRY
    model = Run
    noun = "run"
