"""``seed_demo``: a demo organization with credits, two projects, an operator login and runs.

Idempotent: running it again keeps what exists and prints the same login.
"""

import json
import os

from django.contrib.auth import get_user_model
from django.db import transaction

from billing.selectors import account_balance
from billing.services import account_topup, organization_create
from core.management.base import RunbookCommand
from core.models import Organization, Project
from core.services import project_create
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
    help = "Seed the demo organization, projects, operator account, credits and a few runs (idempotent)."

    def add_arguments(self, parser):
        parser.add_argument("--username", default=os.environ.get("DEMO_USERNAME", "operator"))
        parser.add_argument("--password", default=os.environ.get("DEMO_PASSWORD", "operator"))
        parser.add_argument("--credits", type=int, default=100_000)

    @transaction.atomic
    def handle(self, *args, **options):
        User = get_user_model()
        organization = Organization.objects.filter(name="Demo Org").first()
        if organization is None:
            organization, project, _, _ = organization_create(
                name="Demo Org", owner_username=options["username"], staff=True, credits=options["credits"])
        operator = User.objects.get(username=options["username"]) if User.objects.filter(
            username=options["username"]).exists() else User.objects.create(username=options["username"])
        operator.is_staff = True
        operator.is_superuser = True
        operator.set_password(options["password"])
        operator.save()
        if not organization.memberships.filter(user=operator).exists():
            organization.memberships.create(user=operator, role="owner")
        if not Project.objects.filter(organization=organization, name="research").exists():
            project_create(organization=organization, name="research", actor=operator)
        # Read the balance afresh: ``organization.credit_account`` may be the instance cached when
        # the account was opened, from before the initial top-up.
        if account_balance(organization_id=organization.pk)["available"] < 1000:
            account_topup(organization_id=organization.pk, amount=options["credits"], reason="demo top-up",
                          actor=operator)
        project = Project.objects.get(organization=organization, name="default")
        if not Run.objects.filter(project=project).exists():
            for index in range(3):
                run_create(project=project, name=f"demo run {index + 1}", plan=DEMO_PLAN, actor=operator)
        self.stdout.write(json.dumps({"organization": organization.pk, "username": options["username"],
                                      "password": options["password"]}))
