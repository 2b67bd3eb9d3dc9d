"""Event names the runs app writes, named once.

A run's move into a state writes ``run_<state>``; an agent's, task's or step's ``<entity>_<state>``;
an escalation's ``escalation_<state>``. The other events are named below.
"""

from __future__ import annotations


def run_event(status: str) -> str:
    """The event a run's move into ``status`` writes (``run_completed``, ``run_cancelled`` ...)."""
    return f"run_{status}"


def node_event(entity: str, status: str) -> str:
    """The event an agent's, task's or step's move into ``status`` writes (``step_failed`` ...)."""
    return f"{entity}_{status}"


def escalation_event(status: str) -> str:
    """The event an escalation's move into ``status`` writes (``escalation_open`` ...)."""
    return f"escalation_{status}"


RUN_REPLANNED = "run_replanned"
RUN_RETRY_REFUSED = "run_retry_refused"
RUN_REFUNDED = "run_refunded"
RUN_DELETED = "run_deleted"
RUN_STOPPED = "run_stopped"
RUN_CAP_EXCEEDED = "run_cap_exceeded"
RUN_DRIFT_DETECTED = "run_drift_detected"
RUN_DRIFT_ACKNOWLEDGED = "run_drift_acknowledged"

GATE_PASSED = "gate_passed"
GATE_FAILED = "gate_failed"
GATE_REVALIDATED = "gate_revalidated"

APPROVAL_REQUESTED = "approval_requested"
APPROVAL_GRANTED = "approval_granted"

ESCALATION_UPDATED = "escalation_updated"
