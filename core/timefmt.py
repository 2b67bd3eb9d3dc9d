"""How a moment is written in API resources and event payloads: ISO 8601, or null when there is none."""

from __future__ import annotations

from datetime import date


def isoformat_or_none(value: date | None) -> str | None:
    """``value.isoformat()``, or ``None`` for a moment that has not happened (a null column)."""
    return value.isoformat() if value else None
