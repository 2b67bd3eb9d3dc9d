"""``approve_gate RUN --gate GATE --ref REFERENCE --reason TEXT [--dry-run] [--as USERNAME] [--json]``."""

from django.core.management.base import CommandError

from core.management.base import RunbookActionCommand
from runs.models import Run
from runs.runbooks import RUN_APPROVE_GATE


class Command(RunbookActionCommand):
    help = ("Approve a gate a run waits for (status reason awaiting_approval:<gate>) with an approval reference "
            "no other run or gate has used; the run resumes.")
    runbook = RUN_APPROVE_GATE
    model = Run
    noun = "run"
    many = False

    def add_runbook_arguments(self, parser):
        parser.add_argument("--gate", required=True, help="the gate's name")
        parser.add_argument("--ref", required=True, help="the approval reference (unique across runs and gates)")

    def runbook_options(self, options):
        gate, ref = (options["gate"] or "").strip(), (options["ref"] or "").strip()
        if not gate or not ref:
            raise CommandError("--gate and --ref must not be empty")
        return {"gate": gate, "approval_ref": ref}
