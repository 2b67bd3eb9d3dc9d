"""``recover_stuck_runs --reason TEXT [--older-than 60s] [--limit N] [--dry-run] [--as USERNAME] [--json]``:
the runbook declared in ``runs.runbooks``."""

from core.management.base import runbook_command

Command = runbook_command("recover_stuck_runs")
