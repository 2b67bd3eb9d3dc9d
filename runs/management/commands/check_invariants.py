"""``check_invariants``: exit 1 and list every violation, or exit 0 when all invariants hold."""

import json
import sys

from django.core.management.base import BaseCommand

from runs.invariants import CHECKS, invariants_check
from runs.metrics import invariants_record


class Command(BaseCommand):
    help = ("Check credit conservation (per run attempt and per organization), the ledger's integrity "
            "(append-only hash chain), the run hierarchy and state consistency. Exits 1 on any violation. "
            "The outcome is kept for /metrics (orchestrator_invariant_violations).")

    def add_arguments(self, parser):
        parser.add_argument("--only", action="append", choices=sorted(CHECKS), help="run only these checks")
        parser.add_argument("--json", action="store_true", help="print the result as JSON")

    def handle(self, *args, **options):
        violations = invariants_check(only=options["only"])
        checked = options["only"] or sorted(CHECKS)
        invariants_record(violations_by_check={check: sum(1 for v in violations if v.check == check)
                                               for check in checked})
        if options["json"]:
            self.stdout.write(json.dumps({"ok": not violations,
                                          "violations": [{"check": v.check, "message": v.message}
                                                         for v in violations]}))
        elif violations:
            for violation in violations:
                self.stdout.write(str(violation))
            self.stdout.write(self.style.ERROR(f"{len(violations)} violation(s)"))
        else:
            self.stdout.write(self.style.SUCCESS("all invariants hold"))
        if violations:
            sys.exit(1)
