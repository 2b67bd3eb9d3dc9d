"""``void_run RUN [RUN ...] --reason TEXT [--dry-run] [--as USERNAME] [--json]``."""

from core.management.base import RunbookActionCommand
from runs.models import Run
from runs.runbooks import RUN_VOID


class Command(RunbookActionCommand):
    help = ("Void stopped runs (paused or failed): they end cancelled with the reason voided:<reason>, their phase "
            "idempotency keys are released, pending approvals voided and unused reserved credits refunded.")
    runbook = RUN_VOID
    model = Run
    noun = "run"
