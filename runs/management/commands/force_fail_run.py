"""``force_fail_run RUN [RUN ...] --reason TEXT [--dry-run] [--as USERNAME] [--json]``:
the runbook declared in ``runs.runbooks``."""

from core.management.base import runbook_command

Command = runbook_command("force_fail_run")
