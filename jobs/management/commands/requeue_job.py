"""``requeue_job JOB [JOB ...] --reason TEXT [--dry-run] [--as USERNAME] [--json]``."""

from core.management.base import RunbookActionCommand
from jobs.models import Job
from jobs.runbooks import JOB_REQUEUE


class Command(RunbookActionCommand):
    help = "Put stuck executing jobs back to wait (executing → awaiting_tool, claimable now)."
    runbook = JOB_REQUEUE
    model = Job
    noun = "job"
