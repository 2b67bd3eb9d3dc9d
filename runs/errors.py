"""The runs app's domain errors (each carries its API code and status; see ``core.errors``)."""

from __future__ import annotations

from core.errors import Conflict, DomainError, InvalidTransition


class RunNotStuck(InvalidTransition, code="run_not_stuck"):
    """The run is running and its worker is alive (or its work waits in the queue): nothing to recover."""


class PlanIsContract(Conflict, code="plan_is_contract"):
    """A gated run's plan (its phases, checks, gates and keys) is its contract: it cannot be edited."""


class ApprovalReused(Conflict, code="approval_reused"):
    """An approval reference can approve one gate of one run attempt, once."""


class ApprovalNotPending(Conflict, code="approval_not_pending"):
    """The run is not waiting for an approval of that gate."""


class ApprovalRequired(Conflict, code="approval_required"):
    """The run waits for an approval: resuming it needs the gate's approval reference."""


class DriftNotPending(Conflict, code="drift_not_pending"):
    """There is no unacknowledged drift on the run."""


class DriftDetected(Conflict, code="drift_detected"):
    """Resuming found drift: the run stays stopped as ``stopped_drift:<dimension>``."""


class PipelineKeyInUse(Conflict, code="pipeline_key_in_use"):
    """A phase's idempotency key is held by another run (void that run to release it)."""


class DriftUnacknowledged(Conflict, code="drift_unacknowledged"):
    """The run stopped on drift that no operator has acknowledged yet."""


class ArtifactGone(DomainError, code="artifact_expired", status=410):
    """The artifact expired and its file was deleted."""
