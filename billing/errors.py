"""The billing app's domain errors: credits short, a charge past the reservation, a ledger row changed."""

from __future__ import annotations

from core.errors import DomainError


class InsufficientCredits(DomainError, code="insufficient_credits", status=402):
    """The organization holds fewer credits than the reservation or charge needs."""


class CreditLimitExceeded(DomainError, code="credit_limit_exceeded", status=409):
    """A charge would take a run attempt past what it reserved."""


class AppendOnlyViolation(Exception):
    """Raised when code tries to change or delete a ledger entry."""
