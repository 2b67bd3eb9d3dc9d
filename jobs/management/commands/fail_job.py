"""``fail_job JOB [JOB ...] --reason TEXT [--dry-run] [--as USERNAME] [--json]``."""

from core.management.base import RunbookActionCommand
from jobs.models import Job
from jobs.runbooks import JOB_FAIL


class Command(RunbookActionCommand):
    help = "Fail jobs that have not ended (reason fatal_error; the error names you and your reason)."
    runbook = JOB_FAIL
    model = Job
    noun = "job"
