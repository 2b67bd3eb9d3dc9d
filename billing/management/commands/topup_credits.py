"""Add credits: ``topup_credits ORG --amount N --reason TEXT [--as USERNAME] [--key KEY]``."""

import json

from billing.services import account_topup
from billing.selectors import account_balance
from core.management.base import RunbookCommand
from core.services import organization_get


class Command(RunbookCommand):
    help = "Add credits to an organization (by id or name) as a 'topup' ledger entry."

    def add_arguments(self, parser):
        parser.add_argument("organization", help="organization id or name")
        parser.add_argument("--amount", type=int, required=True)
        parser.add_argument("--reason", required=True)
        parser.add_argument("--as", dest="as_user", help="username recorded as the actor")
        parser.add_argument("--key", help="idempotency key: repeating the same key adds nothing")

    def handle(self, *args, **options):
        actor = self.resolve_actor(options["as_user"])
        organization = organization_get(ref=options["organization"])
        result = account_topup(organization_id=organization.pk, amount=options["amount"], reason=options["reason"],
                               actor=actor, idempotency_key=options["key"])
        self.stdout.write(json.dumps({"entry": result.entry.pk, "created": result.created,
                                      **account_balance(organization_id=organization.pk)}))
