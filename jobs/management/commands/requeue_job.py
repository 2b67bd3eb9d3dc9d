"""``requeue_job JOB [JOB ...] --reason TEXT [--dry-run] [--as USERNAME] [--json]``:
the runbook declared in ``jobs.runbooks``."""

from core.management.base import runbook_command

Command = runbook_command("requeue_job")
