"""Onboard a tenant: ``create_organization NAME --owner USERNAME [--credits N] [--staff]``."""

import json

from billing.services import MAX_AMOUNT, organization_create
from core.management.base import RunbookCommand, whole_number


class Command(RunbookCommand):
    help = ("Create an organization with its credit account, a 'default' project and its owner "
            "(created when missing); prints the ids as JSON.")

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--owner", required=True, help="username of the owner (created if missing)")
        parser.add_argument("--credits", type=whole_number(0, MAX_AMOUNT), default=0,
                            help="initial credits (a topup entry)")
        parser.add_argument("--staff", action="store_true", help="let the owner use the admin")

    def handle(self, *args, **options):
        organization, project, owner, created = organization_create(
            name=options["name"], owner_username=options["owner"], staff=options["staff"],
            credits=options["credits"])
        self.stdout.write(json.dumps({
            "organization": organization.pk, "project": project.pk, "owner": owner.pk,
            "owner_username": owner.get_username(), "owner_created": created, "credits": options["credits"],
        }))
