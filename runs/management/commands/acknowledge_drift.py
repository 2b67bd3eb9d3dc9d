"""``acknowledge_drift RUN [RUN ...] --reason TEXT [--dimension D] [--dry-run] [--as USERNAME] [--json]``:
the runbook declared in ``runs.runbooks``."""

from core.management.base import runbook_command

Command = runbook_command("acknowledge_drift")
