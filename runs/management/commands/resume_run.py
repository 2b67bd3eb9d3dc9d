"""``resume_run RUN [RUN ...] --reason TEXT [--gate GATE --approval-ref REF] [--dry-run] [--as USERNAME] [--json]``."""

from django.core.management.base import CommandError

from core.management.base import RunbookActionCommand
from runs.models import Run
from runs.runbooks import RUN_RESUME


class Command(RunbookActionCommand):
    help = ("Resume paused runs (seed 002 §7): a completed run is left alone, a failed one refused; a gated run's "
            "pins and last passed gate are checked again first (drift stops it again); a run awaiting approval "
            "resumes only with --approval-ref (its gate, or --gate), a run stopped on drift only once acknowledged.")
    runbook = RUN_RESUME
    model = Run
    noun = "run"

    def add_runbook_arguments(self, parser):
        parser.add_argument("--gate", default="", help="the gate a run awaiting approval waits for (default: its own)")
        parser.add_argument("--approval-ref", default="", dest="approval_ref",
                            help="the approval reference for a run awaiting approval (used by no other run or gate)")

    def runbook_options(self, options):
        gate, ref = (options["gate"] or "").strip(), (options["approval_ref"] or "").strip()
        if gate and not ref:
            raise CommandError("--gate needs --approval-ref")
        return {"gate": gate, "approval_ref": ref}
