"""The billing app's domain errors: credits short, a charge past the reservation, a ledger row changed."""

from __future__ import annotations

from core.errors import DomainError


class InsufficientCredits(DomainError):
    code = "insufficient_credits"
    status = 402


class CreditLimitExceeded(DomainError):
    """A charge would take a run attempt past what it reserved."""

    code = "credit_limit_exceeded"
    status = 409


class AppendOnlyViolation(Exception):
    """Raised when code tries to change or delete a ledger entry."""
