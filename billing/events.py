"""Event names the billing app writes: one per ledger entry kind (``ledger_reserve``,
``ledger_charge``, ``ledger_refund``, ``ledger_topup`` ...)."""

from __future__ import annotations


def ledger_event(kind: str) -> str:
    """The event written with a ledger entry of ``kind``."""
    return f"ledger_{kind}"
