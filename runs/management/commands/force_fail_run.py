"""``force_fail_run RUN [RUN ...] --reason TEXT [--dry-run] [--as USERNAME] [--json]``.

Fail live runs now (``force_failed``): live agents end, the unused reservation is released.
"""

from core.management.base import RunbookActionCommand
from runs.models import Run
from runs.runbooks import RUN_FORCE_FAIL


class Command(RunbookActionCommand):
    help = "Force-fail runs (pending, running, resuming or retrying): end their agents, release unused credits."
    runbook = RUN_FORCE_FAIL
    model = Run
    noun = "run"
