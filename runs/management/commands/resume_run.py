"""``resume_run RUN [RUN ...] --reason TEXT [--dry-run] [--as USERNAME] [--json]``."""

from core.management.base import RunbookActionCommand
from runs.models import Run
from runs.runbooks import RUN_RESUME


class Command(RunbookActionCommand):
    help = "Resume paused runs (paused → resuming; a worker picks them up). Gates are approved with approve_gate."
    runbook = RUN_RESUME
    model = Run
    noun = "run"
