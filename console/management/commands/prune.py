"""``prune [--dry-run] [--only STEP ...] [--batch N] [--max-seconds S] [--json]``: retention."""

from __future__ import annotations

import io
import json

import argparse
import math

from django.core.management.base import CommandError

from core.management.base import RunbookCommand, progress_bar, whole_number
from console.retention import STEP_NAMES, retention_prune

MAX_SECONDS = 7 * 86400


def seconds(value: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not math.isfinite(number) or not 0 < number <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{value!r} is out of range: give more than 0 and at most {MAX_SECONDS}")
    return number


class Command(RunbookCommand):
    help = ("Delete what retention allows: expired Idempotency-Key records and artifact files, terminal jobs and "
            "events past their project's retention, ended rate-limit windows, long-gone workers, old task results; "
            "fold pending metric samples. Never ledger or audit rows. Prints a summary table.")

    def add_arguments(self, parser):
        parser.add_argument("--dry-run", action="store_true", help="count what would be deleted; delete nothing")
        parser.add_argument("--only", nargs="+", choices=STEP_NAMES, metavar="STEP",
                            help=f"run only these steps ({', '.join(STEP_NAMES)})")
        parser.add_argument("--batch", type=whole_number(1, 1_000_000), default=None,
                            help="rows per delete transaction (default ORCHESTRATOR_RETENTION_BATCH)")
        parser.add_argument("--max-seconds", type=seconds, default=None,
                            help="stop after this long (the rest is left for the next prune); default: no limit")
        parser.add_argument("--json", action="store_true", help="print the summary as JSON")

    def handle(self, *args, **options):
        bars = []  # one progress bar at a time: the previous step's closes when the next starts

        def close_bar():
            while bars:
                bars.pop().__exit__(None, None, None)

        def on_step(name: str, matched: int):
            close_bar()
            bar = progress_bar(matched, f"prune {name}")
            advance = bar.__enter__()
            bars.append(bar)
            return advance

        try:
            results = retention_prune(dry_run=options["dry_run"], only=options["only"], batch=options["batch"],
                                      max_seconds=options["max_seconds"], on_step=on_step)
        finally:
            close_bar()
        if options["json"]:
            self.stdout.write(json.dumps({
                "dry_run": options["dry_run"],
                "steps": [{"step": r.name, "rule": r.rule, "matched": r.matched,
                           "done": 0 if options["dry_run"] else r.done, "failed": r.failed, "finished": r.finished}
                          for r in results],
            }))
        else:
            self.stdout.write(self.render(results, dry_run=options["dry_run"]), ending="")
        failed = sum(result.failed for result in results)
        if failed:
            raise CommandError(f"{failed} row(s) could not be pruned (see the log); the next prune retries them")

    def render(self, results, *, dry_run: bool) -> str:
        from rich.console import Console
        from rich.table import Table

        interactive = self.stdout.isatty()
        console = Console(record=True, width=None if interactive else 140, force_terminal=interactive,
                          file=io.StringIO())
        title = "Prune (dry run: nothing deleted)" if dry_run else "Prune"
        table = Table(title=title, title_justify="left")
        table.add_column("step")
        table.add_column("rule")
        table.add_column("would delete" if dry_run else "matched", justify="right")
        if not dry_run:
            table.add_column("done", justify="right")
            table.add_column("status")
        for result in results:
            if dry_run:
                table.add_row(result.name, result.rule, str(result.matched))
                continue
            status = "done" if result.finished and not result.failed else (
                f"{result.failed} failed" if result.failed else "stopped (time budget)")
            table.add_row(result.name, result.rule, str(result.matched), str(result.done), status)
        console.print(table)
        return console.export_text(styles=interactive)
