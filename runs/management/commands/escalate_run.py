"""``escalate_run RUN [RUN ...] --reason TEXT [--severity S] [--dry-run] [--as USERNAME] [--json]``:
the runbook declared in ``runs.runbooks``."""

from core.management.base import runbook_command

Command = runbook_command("escalate_run")
