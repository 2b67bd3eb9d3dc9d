"""``refund_run RUN [RUN ...] --reason TEXT [--amount N] [--key KEY] [--dry-run] [--as USERNAME] [--json]``:
the runbook declared in ``runs.runbooks``."""

from core.management.base import runbook_command

Command = runbook_command("refund_run")
