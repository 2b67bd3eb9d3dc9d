"""The domain errors every service raises.

Each error carries a stable machine-readable ``code``, an HTTP ``status`` for the API, a
human ``detail`` and optional ``extra`` fields. The API maps them once to responses, the
admin to ``message_user(ERROR)`` and management commands to ``CommandError``.
"""

from __future__ import annotations

from typing import Any


class DomainError(Exception):
    code = "domain_error"
    status = 400
    sends_retry_after = False  # the API sends ``extra["retry_after"]`` as a ``Retry-After`` header

    def __init__(self, detail: str, *, code: str | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        self.extra = extra

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "detail": self.detail, **self.extra}


class ValidationFailed(DomainError):
    """Bad input. ``errors`` maps a field path (``agents[0].tasks[1].name``) to messages."""

    code = "validation_error"
    status = 400

    def __init__(self, detail: str, *, errors: dict[str, list[str]] | None = None) -> None:
        super().__init__(detail, errors=errors or {})
        self.errors = errors or {}


class NotFound(DomainError):
    code = "not_found"
    status = 404


class PermissionRefused(DomainError):
    code = "permission_denied"
    status = 403


class InvalidTransition(DomainError):
    """A transition was requested from a state that does not allow it."""

    code = "invalid_transition"
    status = 409

    def __init__(self, *, entity: str, entity_id: Any, current: str, requested: str, why: str = "") -> None:
        detail = f"{entity} {entity_id} is {current}; cannot {requested}"
        if why:
            detail = f"{detail}: {why}"
        super().__init__(detail, entity=entity, id=entity_id, **{"from": current, "to": requested})
        self.entity = entity
        self.entity_id = entity_id
        self.current = current
        self.requested = requested


class Conflict(DomainError):
    code = "conflict"
    status = 409


class IdempotencyKeyInUse(Conflict):
    """The first request with this key is still running."""

    code = "idempotency_key_in_use"


class IdempotencyKeyReused(DomainError):
    """The key was used on this endpoint with another request body."""

    code = "idempotency_key_reused"
    status = 422
