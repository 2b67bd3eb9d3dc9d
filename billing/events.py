"""Event names the billing app writes: one per ledger entry kind (``ledger_reserve``,
``ledger_charge``, ``ledger_refund``, ``ledger_topup`` ...).

The payload schema of each event (``EVENT_MESSAGES``) is part of the AsyncAPI document of the
events socket (``core.asyncapi``).
"""

from __future__ import annotations

from billing.models import LedgerEntry
from core.asyncapi import ID, INTEGER, STRING, EventMessage, nullable

def ledger_event(kind: str) -> str:
    """The event written with a ledger entry of ``kind``."""
    return f"ledger_{kind}"


# --- payload schemas -----------------------------------------------------------------------------

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
