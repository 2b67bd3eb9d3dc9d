"""``seed_demo``: a demo organization with credits, three projects, an operator login and runs.

The third project, ``nightly``, is made with its queue paused (a reason, by the operator): the
dashboard lists it, and ``demo_stream`` keeps a run waiting in it.

Idempotent: running it again keeps what exists. The operator login is made (staff, superuser,
the given password) only when no user of that name exists: an existing user keeps its password,
staff status and groups, and the output says so.
"""

import json
import os

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError
from django.db import transaction

from billing.selectors import account_balance
from billing.services import MAX_AMOUNT, account_topup, organization_create
from core.management.base import RunbookCommand, whole_number
from core.models import Organization, Project
from core.services import project_create
from jobs.services import queue_pause
from runs.demo import PAUSED_PROJECT, PAUSED_REASON
from runs.models import Run
from runs.services import run_create

DEMO_PLAN = {
    "max_agents": 2,
    "agents": [
        {"name": "research", "parallelism_mode": "dag", "tasks": [
            {"name": "fetch", "steps": [
                {"name": "hello", "tool": "echo", "args": {"text": "hi"}},
                {"name": "wait", "tool": "sleep", "args": {"seconds": 0.2}},
            ]},
            {"name": "report", "depends_on": ["fetch"], "steps": [
                {"name": "summary", "tool": "echo", "args": {"text": "done"}},
            ]},
        ]},
        {"name": "drill", "failure_mode": "continue", "tasks": [
            {"name": "flaky", "steps": [{"name": "flaky", "tool": "fail", "args": {"mode": "retryable", "times": 1}}]},
        ]},
    ],
}


class Command(RunbookCommand):
    help = ("Seed the demo organization, projects, operator account, credits and a few runs (idempotent; "
            "--dry-run lists what it would create).")

    def add_arguments(self, parser):
        parser.add_argument("--username", default=os.environ.get("DEMO_USERNAME", "operator"))
        parser.add_argument("--password", default=os.environ.get("DEMO_PASSWORD", "operator"))
        parser.add_argument("--credits", type=whole_number(1, MAX_AMOUNT), default=100_000)
        parser.add_argument("--reason", default="demo seed", help="recorded on the top-up and the audit records")
        parser.add_argument("--as", dest="as_user", metavar="USERNAME",
                            help="the audit actor (default: the demo operator)")
        parser.add_argument("--dry-run", action="store_true", help="list what would be created; create nothing")

    def handle(self, *args, **options):
        reason = (options["reason"] or "").strip()
        if not reason:
            raise CommandError("--reason must not be empty")
        actor = self.resolve_actor(options["as_user"])
        with transaction.atomic():
            organization, created, user_made = self.seed(options, actor=actor, reason=reason)
            if options["dry_run"]:
                transaction.set_rollback(True)  # everything above, undone: the list is exact
        if options["dry_run"]:
            self.stdout.write(json.dumps({"dry_run": True, "would_create": created}))
            return
        result = {"organization": organization.pk, "username": options["username"],
                  "password": options["password"] if user_made else None, "created": created}
        if not user_made:
            result["note"] = (f"user {options['username']!r} already existed: its password, staff status and "
                              f"groups were left as they are")
        self.stdout.write(json.dumps(result))

    def seed(self, options, *, actor, reason: str) -> tuple[Organization, list[str], bool]:
        User = get_user_model()
        created: list[str] = []
        # A user of that name made by anyone (even an earlier seed) is never promoted, nor its
        # password reset: only the login this run makes gets staff, superuser and the password.
        user_made = not User.objects.filter(username=options["username"]).exists()
        organization = Organization.objects.filter(name="Demo Org").first()
        if organization is None:
            organization, project, _, _ = organization_create(
                name="Demo Org", owner_username=options["username"], staff=False, credits=options["credits"],
                actor=actor)
            created += [f"organization 'Demo Org' with project 'default' and owner {options['username']!r}",
                        f"{options['credits']} credits"]
        operator = User.objects.filter(username=options["username"]).first()
        if operator is None:
            operator = User.objects.create(username=options["username"])
        if user_made:
            operator.is_staff = True
            operator.is_superuser = True
            operator.set_password(options["password"])
            operator.save()
            created.append(f"user {options['username']!r} (staff, superuser)")
        actor = actor or operator
        if not organization.memberships.filter(user=operator).exists():
            organization.memberships.create(user=operator, role="owner")
            created.append(f"{options['username']!r} as the organization's owner")
        if not Project.objects.filter(organization=organization, name="research").exists():
            project_create(organization=organization, name="research", actor=actor)
            created.append("project 'research'")
        if not Project.objects.filter(organization=organization, name=PAUSED_PROJECT).exists():
            nightly = project_create(organization=organization, name=PAUSED_PROJECT, actor=actor)
            queue_pause(project_id=nightly.pk, actor=actor, reason=PAUSED_REASON)
            created.append(f"project {PAUSED_PROJECT!r} with its queue paused")
        # Read the balance afresh: ``organization.credit_account`` may be the instance cached when
        # the account was opened, from before the initial top-up.
        if account_balance(organization_id=organization.pk)["available"] < 1000:
            account_topup(organization_id=organization.pk, amount=options["credits"], reason=reason, actor=actor)
            created.append(f"a top-up of {options['credits']} credits")
        project = Project.objects.get(organization=organization, name="default")
        if not Run.objects.filter(project=project).exists():
            for index in range(3):
                run_create(project=project, name=f"demo run {index + 1}", plan=DEMO_PLAN, actor=actor, reason=reason)
            created.append("3 demo runs")
        return organization, created, user_made
