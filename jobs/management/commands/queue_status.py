"""``queue_status [--json] [--limit N]``: queue depth by lane and type, executing jobs, workers."""

import io
import json

from django.core.management.base import BaseCommand

from core.management.base import whole_number
from jobs.selectors import queue_status


def _seconds(value) -> str:
    return "—" if value is None else f"{value:.0f} s"


class Command(BaseCommand):
    help = "Show the queue: depth by lane and type, executing jobs and their age, worker processes seen."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="print the snapshot as JSON")
        parser.add_argument("--limit", type=whole_number(1, 100_000), default=50,
                            help="rows of executing jobs and workers (default 50)")

    def handle(self, *args, **options):
        status = queue_status(limit=options["limit"])
        if options["json"]:
            self.stdout.write(json.dumps(status))
            return
        self.stdout.write(self.render(status), ending="")

    def render(self, status: dict) -> str:
        from rich.console import Console
        from rich.table import Table

        interactive = self.stdout.isatty()
        # Recorded, then written once through self.stdout (with colour on a terminal only).
        console = Console(record=True, width=None if interactive else 140, force_terminal=interactive,
                          file=io.StringIO())
        console.print(f"[bold]Queue[/bold] at {status['at']}: {status['waiting']} waiting, "
                      f"{status['executing']} executing of {status['concurrency']} slots, "
                      f"{status['received']} received, {status['awaiting_user_confirmation']} awaiting confirmation")
        lanes = Table(title="Depth by lane and type", title_justify="left")
        for column, justify in (("lane", "left"), ("type", "left"), ("waiting", "right"), ("executing", "right"),
                                ("oldest waiting", "right")):
            lanes.add_column(column, justify=justify)
        for row in status["lanes"]:
            lanes.add_row(row["lane"] or "(none)", row["type"], str(row["waiting"]), str(row["executing"]),
                          _seconds(row["oldest_waiting_s"]))
        console.print(lanes if status["lanes"] else "No job waiting or executing.")
        executing = Table(title="Executing jobs", title_justify="left")
        for column in ("job", "type", "lane", "run", "worker", "attempt", "age", "lease left", "cancel"):
            executing.add_column(column)
        for row in status["executing_jobs"]:
            executing.add_row(str(row["id"]), row["type"], row["lane"] or "", str(row["run"] or ""), row["worker"],
                              str(row["attempt"]), _seconds(row["age_s"]), _seconds(row["lease_left_s"]),
                              "requested" if row["cancel_requested"] else "")
        if status["executing_jobs"]:
            console.print(executing)
        workers = Table(title="Workers seen", title_justify="left")
        for column in ("worker", "cluster", "last seen", "alive", "current job", "jobs done", "up"):
            workers.add_column(column)
        for row in status["workers"]:
            workers.add_row(row["worker"], row["cluster"], f"{_seconds(row['last_seen_s'])} ago",
                            "yes" if row["alive"] else "NO", str(row["current_job"] or ""), str(row["jobs_done"]),
                            _seconds(row["up_s"]))
        console.print(workers if status["workers"] else "No worker has been seen.")
        return console.export_text(styles=interactive)
