"""The jobs app's domain errors: queue caps, job transitions outside the matrix, commands, sessions."""

from __future__ import annotations

from core.errors import Conflict, DomainError, InvalidTransition


class JobConflict(InvalidTransition):
    """A job transition outside seed 000's matrix (terminal states are immutable)."""

    code = "job_conflict"


class QueueFull(DomainError):
    """A per-project or global queue cap was reached; ``retry_after`` says when to try again."""

    code = "queue_full"
    status = 429
    sends_retry_after = True


class QueueDisabled(DomainError):
    code = "queue_disabled"
    status = 503


class CommandConflict(DomainError):
    """The same command idempotency key was used with another payload."""

    code = "command_conflict"
    status = 409


class SystemSessionRefused(DomainError):
    """User operations on system-owned worker sessions are refused."""

    code = "system_session"
    status = 403


class CommandFailed(DomainError):
    """The adapter or tool failed the command. ``retryable`` failures leave it replayable."""

    code = "command_failed"
    status = 422

    def __init__(self, detail: str, *, reason: str, retryable: bool, command_id: int | None = None) -> None:
        super().__init__(detail, reason=reason, retryable=retryable, command_id=command_id)
        self.reason = reason
        self.retryable = retryable  # read by jobs.registry.classify_default
        if retryable:
            self.status = 503


class QueuePauseConflict(Conflict):
    """Pausing a queue that is paused already, or resuming one that is not paused."""

    code = "queue_pause_conflict"
