"""``resume_run RUN [RUN ...] --reason TEXT [--gate GATE --approval-ref REF] [--dry-run] [--as USERNAME] [--json]``:
the runbook declared in ``runs.runbooks``."""

from core.management.base import runbook_command

Command = runbook_command("resume_run")
