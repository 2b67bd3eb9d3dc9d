"""The runs app's domain errors (each carries its API code and status; see ``core.errors``)."""

from __future__ import annotations

from core.errors import Conflict, DomainError, InvalidTransition


class RunNotStuck(InvalidTransition):
    """The run is running and its worker is alive (or its work waits in the queue): nothing to recover."""

    code = "run_not_stuck"


class PlanIsContract(Conflict):
    """A gated run's plan (its phases, checks, gates and keys) is its contract: it cannot be edited."""

    code = "plan_is_contract"


class ApprovalReused(Conflict):
    code = "approval_reused"


class ApprovalNotPending(Conflict):
    code = "approval_not_pending"


class ApprovalRequired(Conflict):
    """The run waits for an approval: resuming it needs the gate's approval reference."""

    code = "approval_required"


class DriftNotPending(Conflict):
    """There is no unacknowledged drift on the run."""

    code = "drift_not_pending"


class DriftDetected(Conflict):
    """Resuming found drift: the run stays stopped as ``stopped_drift:<dimension>``."""

    code = "drift_detected"


class PipelineKeyInUse(Conflict):
    """A phase's idempotency key is held by another run (void that run to release it)."""

    code = "pipeline_key_in_use"


class DriftUnacknowledged(Conflict):
    """The run stopped on drift that no operator has acknowledged yet."""

    code = "drift_unacknowledged"


class ArtifactGone(DomainError):
    """The artifact expired and its file was deleted."""

    code = "artifact_expired"
    status = 410
