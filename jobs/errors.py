"""The jobs app's domain errors: queue caps, job transitions outside the matrix, commands, sessions."""

from __future__ import annotations

from core.errors import Conflict, DomainError, InvalidTransition


class JobConflict(InvalidTransition, code="job_conflict"):
    """A job transition outside seed 000's matrix (terminal states are immutable)."""


class QueueFull(DomainError, code="queue_full", status=429):
    """A per-project or global queue cap was reached; ``retry_after`` says when to try again."""

    sends_retry_after = True


class QueueDisabled(DomainError, code="queue_disabled", status=503):
    """The job queue is switched off (``ORCHESTRATOR_QUEUE_ENABLED=false``)."""


class CommandConflict(DomainError, code="command_conflict", status=409):
    """The same command idempotency key was used with another payload."""


class SystemSessionRefused(DomainError, code="system_session", status=403):
    """User operations on system-owned worker sessions are refused."""


class CommandFailed(DomainError, code="command_failed", status=422):
    """The adapter or tool failed the command. ``retryable`` failures leave it replayable."""

    def __init__(self, detail: str, *, reason: str, retryable: bool, command_id: int | None = None) -> None:
        super().__init__(detail, reason=reason, retryable=retryable, command_id=command_id)
        self.reason = reason
        self.retryable = retryable  # read by jobs.registry.classify_default
        if retryable:
            self.status = 503


class QueuePauseConflict(Conflict, code="queue_pause_conflict"):
    """Pausing a queue that is paused already, or resuming one that is not paused."""
