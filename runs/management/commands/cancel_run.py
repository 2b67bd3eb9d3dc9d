"""``cancel_run RUN [RUN ...] --reason TEXT [--dry-run] [--as USERNAME] [--json]``."""

from core.management.base import RunbookActionCommand
from runs.models import Run
from runs.runbooks import RUN_CANCEL


class Command(RunbookActionCommand):
    help = "Cancel runs (created, pending, running or paused): end their agents, release every credit not charged."
    runbook = RUN_CANCEL
    model = Run
    noun = "run"
