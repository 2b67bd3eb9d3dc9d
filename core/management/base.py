"""What every runbook command shares: domain errors become ``CommandError``, never a traceback.

``RunbookActionCommand`` is the shell face of a ``core.runbooks.Runbook``: ``<command> ID [ID ...]
--reason TEXT [--dry-run] [--as USERNAME] [--json]`` and the runbook's own arguments, or
``--filter QUERY`` instead of ids: every object the admin's list shows for that query string,
applied as a tracked bulk operation (``core.bulk``) with a progress bar. It plans
or applies the runbook to each object, prints one line per object (done, skipped and why,
refused and why) and ends with a ``CommandError`` when any object was refused. A runbook's
command module is one line: ``Command = runbook_command("<command>")``.
"""

from __future__ import annotations

import argparse
import getpass
import json
import re
import sys
from contextlib import contextmanager

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from core.bulk import LabelActor, bulk_operation_process, bulk_operation_start, runbook_filter_queryset
from core.errors import DomainError
from core.runbooks import (
    DONE,
    PLANNED,
    REFUSED,
    SKIPPED,
    Runbook,
    describe_error,
    runbook_execute,
    runbook_for_command,
)

__all__ = ["RunbookCommand", "RunbookActionCommand", "ShellActor", "describe_error", "positive_id", "progress_bar",
           "runbook_command", "whole_number"]


class ShellActor(LabelActor):
    """The person at the shell when no ``--as`` user is named: audited by label only
    (``shell:<os user>``), with no user row behind it."""

    def __init__(self, label: str | None = None) -> None:
        super().__init__(label or f"shell:{_os_user()}")


def _os_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name in this environment (containers, cron)
        return "unknown"


@contextmanager
def progress_bar(total: int, description: str):
    """A rich progress bar on an interactive stderr; nothing otherwise. Yields ``advance()``."""
    if total < 2 or not sys.stderr.isatty():
        yield lambda *args: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda *args: progress.advance(task)


class RunbookCommand(BaseCommand):
    """A command that calls services and reports domain errors as ``CommandError``."""

    def execute(self, *args, **options):
        try:
            return super().execute(*args, **options)
        except DomainError as exc:
            raise CommandError(describe_error(exc)) from exc

    @staticmethod
    def resolve_actor(username: str | None):
        if not username:
            return None
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"user {username!r} does not exist")
        return user

    @classmethod
    def resolve_operator(cls, username: str | None):
        """The audit actor of a runbook: the ``--as`` user, or the shell user by label."""
        return cls.resolve_actor(username) or ShellActor()


MAX_ID = 2**63 - 1  # the largest id a row can have (a 64-bit primary key)


def positive_id(value: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number <= 0 or number > MAX_ID:
        raise argparse.ArgumentTypeError(f"{value!r} is not an id (a whole number from 1 to {MAX_ID})")
    return number


DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_DURATION_S = 3650 * 86400  # ten years: silence beyond that is a typo


def duration_s(value: str, *, option: str) -> int:
    """A duration argument (``90``, ``90s``, ``5m``, ``2h``, ``1d``) in seconds, or ``CommandError``."""
    match = re.fullmatch(r"\s*(\d{1,12})\s*([smhd]?)\s*", value or "")
    if not match:
        raise CommandError(f"{option} {value!r}: give a duration such as 90, 90s, 5m, 2h or 1d")
    seconds = int(match.group(1)) * DURATION_UNITS[match.group(2)]
    if seconds > MAX_DURATION_S:
        raise CommandError(f"{option} {value!r}: at most 3650d")
    return seconds


def whole_number(low: int, high: int):
    """An argparse type: a whole number from ``low`` to ``high`` (a clear error otherwise)."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{value!r} is out of range: give {low} to {high:,}")
        return number

    parse.__name__ = "whole number"
    return parse


class RunbookActionCommand(RunbookCommand):
    """Apply one runbook (``runbook``) to objects given by id, or to those the runbook selects."""

    runbook: Runbook

    def add_arguments(self, parser):
        self.add_target_arguments(parser)
        if self.runbook.arguments is not None:
            self.runbook.arguments(parser)
        parser.add_argument("--reason", required=True, help="why: recorded in the audit trail")
        parser.add_argument("--dry-run", action="store_true", help="show what would happen; change nothing")
        parser.add_argument("--as", dest="as_user", metavar="USERNAME",
                            help="the user recorded as the actor (default: the shell user, by name)")
        parser.add_argument("--json", action="store_true", help="print the results as JSON")

    def add_target_arguments(self, parser) -> None:
        """The objects: ids, or ``--filter`` (the admin changelist's query string), unless the runbook selects them."""
        runbook = self.runbook
        if runbook.targets is not None:
            return
        if not runbook.many:
            parser.add_argument("ids", type=positive_id, metavar=runbook.noun.upper(), help=f"{runbook.noun} id")
            return
        parser.add_argument("ids", nargs="*", type=positive_id, metavar=runbook.noun.upper(),
                            help=f"{runbook.noun} ids (or --filter)")
        parser.add_argument("--filter", dest="query", metavar="QUERY",
                            help="every object the admin's list shows with this query string (e.g. "
                                 "'status=failed&project__id__exact=3'; list filters and q= searches included)")

    @property
    def noun(self) -> str:
        return self.runbook.noun

    def runbook_options(self, options) -> dict:
        return self.runbook.command_options(options) if self.runbook.command_options else {}

    def targets(self, options, runbook_options: dict) -> list:
        if self.runbook.targets is not None:
            return list(self.runbook.targets(options, runbook_options))
        ids = options["ids"] if self.runbook.many else [options["ids"]]
        if not ids:
            raise CommandError(f"give {self.noun} ids, or --filter with the admin list's query string")
        found = {obj.pk: obj for obj in self.runbook.model._default_manager.filter(pk__in=ids)}
        missing = [str(pk) for pk in ids if pk not in found]
        if missing:
            raise CommandError(f"{self.noun} {', '.join(missing)} does not exist")
        return [found[pk] for pk in dict.fromkeys(ids)]

    def handle(self, *args, **options):
        reason = (options["reason"] or "").strip()
        if not reason:
            raise CommandError("--reason must not be empty: say why, it is recorded in the audit trail")
        actor = self.resolve_operator(options["as_user"])
        self.check_permission(actor)
        runbook_options = self.runbook_options(options)
        if options.get("query") is not None:
            return self.handle_filter(options, actor=actor, reason=reason, runbook_options=runbook_options)
        targets = self.targets(options, runbook_options)
        self.report(self.apply(targets, actor=actor, reason=reason, runbook_options=runbook_options,
                               dry_run=options["dry_run"]), options)

    def handle_filter(self, options, *, actor, reason: str, runbook_options: dict) -> None:
        """``--filter``: every object the admin list shows for the query string. A dry run plans each
        one; otherwise a bulk operation (``core.bulk``) is recorded and processed here, batch by batch."""
        if options["ids"]:
            raise CommandError(f"give {self.noun} ids or --filter, not both")
        queryset = runbook_filter_queryset(self.runbook, options["query"], user=actor)
        matched = queryset.count()
        if not options["json"]:
            self.stdout.write(f"{matched} {self.noun}{'s' if matched != 1 else ''} match --filter "
                              f"{options['query']!r}")
        if options["dry_run"]:
            outcomes = self.apply(list(queryset), actor=actor, reason=reason, runbook_options=runbook_options,
                                  dry_run=True)
            return self.report(outcomes, options, matched=matched)
        operation = bulk_operation_start(runbook=self.runbook, query=options["query"], actor=actor, reason=reason,
                                         options=runbook_options, queryset=queryset)
        outcomes: list = []
        with progress_bar(operation.total, f"{self.runbook.title.lower()} {operation.total} {self.noun}s "
                                           f"(bulk operation {operation.pk})") as advance:
            def batch_done(batch: list) -> None:
                outcomes.extend(batch)
                for outcome in batch:
                    advance(outcome)

            operation = bulk_operation_process(operation_id=operation.pk, on_outcomes=batch_done)
        self.report(outcomes, options, matched=matched, operation=operation.pk)

    def check_permission(self, actor) -> None:
        """A named ``--as`` user needs the runbook's permission, as in the admin (the shell user,
        audited by label, is trusted with the shell)."""
        if getattr(actor, "pk", None) is None or actor.has_perm(self.runbook.permission):
            return
        why = "is inactive" if not actor.is_active else f"lacks the permission {self.runbook.permission!r}"
        raise CommandError(f"user {actor.get_username()!r} {why}: cannot {self.runbook.title.lower()} "
                           f"(the Operators group has it)")

    def apply(self, targets: list, *, actor, reason: str, runbook_options: dict, dry_run: bool) -> list:
        verb = "planning" if dry_run else self.runbook.title.lower()
        with progress_bar(len(targets), f"{verb} {len(targets)} {self.noun}s") as advance:
            return runbook_execute(self.runbook, targets, actor=actor, reason=reason, options=runbook_options,
                                   dry_run=dry_run, on_each=advance)

    def report(self, outcomes: list, options, **extra) -> None:
        counts = {result: sum(1 for outcome in outcomes if outcome.result == result)
                  for result in (DONE, PLANNED, SKIPPED, REFUSED)}
        if options["json"]:
            self.stdout.write(json.dumps({
                "action": self.runbook.name, "dry_run": options["dry_run"], **extra,
                "results": [{self.noun: outcome.target.pk, "result": outcome.result, "detail": outcome.detail}
                            for outcome in outcomes],
                **counts,
            }))
        else:
            styles = {DONE: self.style.SUCCESS, PLANNED: self.style.NOTICE, SKIPPED: self.style.WARNING,
                      REFUSED: self.style.ERROR}
            prefix = "dry run: " if options["dry_run"] else ""
            for outcome in outcomes:
                label = "would do" if outcome.result == PLANNED else outcome.result
                self.stdout.write(styles[outcome.result](
                    f"{prefix}{self.noun} {outcome.target.pk}: {label}: {outcome.detail}"))
            if extra.get("operation"):
                self.stdout.write(f"bulk operation {extra['operation']} (in the admin: Bulk operations)")
            if len(outcomes) > 1 or not outcomes:
                self.stdout.write(", ".join(f"{n} {result}" for result, n in counts.items() if n) or "nothing to do")
        refused = [outcome for outcome in outcomes if outcome.result == REFUSED]
        if len(refused) == 1 and len(outcomes) == 1:
            raise CommandError(f"{self.noun} {refused[0].target.pk}: {refused[0].detail}")
        if refused:
            raise CommandError(f"{len(refused)} of {len(outcomes)} {self.noun}s refused: "
                               + "; ".join(f"{o.target.pk}: {o.detail}" for o in refused[:5]))


def runbook_command(command: str) -> type[RunbookActionCommand]:
    """The ``Command`` class of the registered runbook whose command is ``command``."""
    runbook = runbook_for_command(command)
    return type("Command", (RunbookActionCommand,), {
        "runbook": runbook, "help": runbook.description, "__doc__": f"``{command}``: {runbook.title.lower()}."})
