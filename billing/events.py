"""The events ``billing`` writes (see ``core.asyncapi``)."""

from billing.models import LedgerEntry
from core.asyncapi import ID, INTEGER, STRING, EventMessage, nullable

EVENT_MESSAGES = [
    EventMessage(
        types=tuple(f"ledger_{kind}" for kind in LedgerEntry.Kind.values), family="ledger_<kind>",
        summary="A ledger entry was appended (the account's figures after it)",
        properties={
            "entry": {**ID, "description": "the ledger entry"},
            "kind": {"enum": list(LedgerEntry.Kind.values)},
            "source": {"enum": list(LedgerEntry.Source.values), "description": "refunds: what was given back"},
            "amount": INTEGER,
            "attempt": {**nullable(INTEGER), "description": "the run attempt it belongs to"},
            "balance": INTEGER, "reserved": INTEGER, "available": INTEGER,
        },
        required=("entry", "kind", "source", "amount", "attempt", "balance", "reserved", "available")),
    EventMessage(types=("organization_created",), summary="An organization was onboarded (with a default project)",
                 properties={"name": STRING}, required=("name",)),
]
