"""A run's sub-state: the reason behind a paused or ended status (DESIGN §4, seed 002).

``Run.status_reason`` holds ``<kind>:<detail>`` — ``awaiting_approval:<gate>``,
``stopped_drift:<dimension>``, ``stop_and_escalate:<cap>``, ``voided:<reason>`` — or free text.
Build it with ``status_reason`` and read it with ``StatusReason.parse``; nothing else spells out
the prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

MAX_LENGTH = 200  # Run.status_reason's column
GATE_DIMENSION = "gate:"  # a drift dimension naming a gate whose invariants no longer hold


class SubState(StrEnum):
    AWAITING_APPROVAL = "awaiting_approval"
    STOPPED_DRIFT = "stopped_drift"
    STOP_AND_ESCALATE = "stop_and_escalate"
    VOIDED = "voided"

    @property
    def prefix(self) -> str:
        return f"{self.value}:"


@dataclass(frozen=True)
class StatusReason:
    kind: SubState | None  # None: free text (or empty)
    detail: str

    @classmethod
    def parse(cls, text: str | None) -> StatusReason:
        text = text or ""
        for kind in SubState:
            if text.startswith(kind.prefix):
                return cls(kind, text[len(kind.prefix):])
        return cls(None, text)

    def is_(self, kind: SubState, detail: str | None = None) -> bool:
        return self.kind == kind and (detail is None or self.detail == detail)


def status_reason(kind: SubState, detail: str) -> str:
    """The ``status_reason`` text of a sub-state, cut to the column's length."""
    return f"{kind.prefix}{detail}"[:MAX_LENGTH]
