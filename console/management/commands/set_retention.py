"""``set_retention PROJECT (--days N | --default) --reason TEXT [--as USER]``: a project's retention."""

from __future__ import annotations

from django.conf import settings

from core.management.base import RunbookCommand, positive_id
from console.retention import project_retention_set


class Command(RunbookCommand):
    help = ("Keep a project's terminal jobs and events for N days (0: prune them after an hour), or go back to "
            "ORCHESTRATOR_RETENTION_DAYS with --default. Ledger and audit rows are never pruned. Audited.")

    def add_arguments(self, parser):
        parser.add_argument("project", type=positive_id, help="project id")
        which = parser.add_mutually_exclusive_group(required=True)
        which.add_argument("--days", type=int, help="days to keep terminal jobs and events")
        which.add_argument("--default", action="store_true", help="use ORCHESTRATOR_RETENTION_DAYS")
        parser.add_argument("--reason", required=True, help="why (kept in the audit record)")
        parser.add_argument("--as", dest="as_user", default=None, help="the audit actor (default: the shell user)")

    def handle(self, *args, **options):
        days = None if options["default"] else options["days"]
        project = project_retention_set(project_id=options["project"], days=days,
                                        actor=self.resolve_operator(options["as_user"]), reason=options["reason"])
        effective = project.retention_days if project.retention_days is not None \
            else f"{settings.ORCHESTRATOR_RETENTION_DAYS} (the default)"
        self.stdout.write(f"project {project.pk} ({project}): terminal jobs and events kept {effective} days")
