"""``recover_stuck_runs --reason TEXT [--older-than 60s] [--limit N] [--dry-run] [--as USERNAME] [--json]``.

Seed 001 §9.1: running runs whose worker has been silent longer than ``--older-than``
(default ``ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S``) and whose work is not simply waiting in
the queue fail with ``heartbeat_timeout``: their agents are terminated and the unused
reservation is refunded.
"""

import re

from django.conf import settings
from django.core.management.base import CommandError

from core.management.base import RunbookActionCommand, whole_number
from runs.runbooks import RUN_RECOVER
from runs.selectors import runs_heartbeat_stale

UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_DURATION_S = 3650 * 86400  # ten years: silence beyond that is a typo


def duration_s(value: str) -> int:
    match = re.fullmatch(r"\s*(\d{1,12})\s*([smhd]?)\s*", value or "")
    if not match:
        raise CommandError(f"--older-than {value!r}: give a duration such as 90, 90s, 5m, 2h or 1d")
    seconds = int(match.group(1)) * UNITS[match.group(2)]
    if seconds > MAX_DURATION_S:
        raise CommandError(f"--older-than {value!r}: at most 3650d")
    return seconds


class Command(RunbookActionCommand):
    help = ("Recover stuck runs (seed 001 §9.1): fail running runs without a worker heartbeat for --older-than "
            "with heartbeat_timeout, terminating their agents and refunding the unused reservation.")
    runbook = RUN_RECOVER
    noun = "run"

    def add_arguments(self, parser):
        parser.add_argument("--older-than", help="silence that makes a run stuck: 90, 90s, 5m, 2h, 1d "
                                                 "(default: ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S)")
        parser.add_argument("--limit", type=whole_number(1, 1_000_000), default=1000,
                            help="recover at most this many runs (default 1000)")
        parser.add_argument("--reason", required=True, help="why: recorded in the audit trail")
        parser.add_argument("--dry-run", action="store_true", help="list the stuck runs; change nothing")
        parser.add_argument("--as", dest="as_user", metavar="USERNAME",
                            help="the user recorded as the actor (default: the shell user, by name)")
        parser.add_argument("--json", action="store_true", help="print the results as JSON")

    def runbook_options(self, options):
        older_than = options["older_than"]
        seconds = settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S if older_than is None else duration_s(older_than)
        return {"older_than_s": seconds}

    def targets(self, options):
        older_than_s = self.runbook_options(options)["older_than_s"]
        return list(runs_heartbeat_stale(older_than_s=older_than_s)[:options["limit"]])
