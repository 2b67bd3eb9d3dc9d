"""``cancel_job JOB [JOB ...] --reason TEXT [--dry-run] [--as USERNAME] [--json]``."""

from core.management.base import RunbookActionCommand
from jobs.models import Job
from jobs.runbooks import JOB_CANCEL


class Command(RunbookActionCommand):
    help = "Cancel jobs: waiting ones at once, executing ones cooperatively (the worker stops them)."
    runbook = JOB_CANCEL
    model = Job
    noun = "job"
