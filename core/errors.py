"""The domain errors every service raises.

Each error carries a stable machine-readable ``code``, an HTTP ``status`` for the API, a
human ``detail`` and optional ``extra`` fields. The API maps them once to responses, the
admin to ``message_user(ERROR)`` and management commands to ``CommandError``.
"""

from __future__ import annotations

from typing import Any


class DomainError(Exception):
    """The base of every domain error; a subclass names its ``code`` and ``status`` in its class line.

    ``class QueueDisabled(DomainError, code="queue_disabled", status=503)``: a subclass that names
    no ``status`` keeps its base's (``Conflict`` and its subclasses answer 409).
    """

    code = "domain_error"
    status = 400
    sends_retry_after = False  # the API sends ``extra["retry_after"]`` as a ``Retry-After`` header

    def __init_subclass__(cls, *, code: str | None = None, status: int | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if status is not None:
            cls.status = status

    def __init__(self, detail: str, *, code: str | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        self.extra = extra

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "detail": self.detail, **self.extra}


class ValidationFailed(DomainError, code="validation_error", status=400):
    """Bad input. ``errors`` maps a field path (``agents[0].tasks[1].name``) to messages."""

    def __init__(self, detail: str, *, errors: dict[str, list[str]] | None = None) -> None:
        super().__init__(detail, errors=errors or {})
        self.errors = errors or {}


class NotFound(DomainError, code="not_found", status=404):
    """The object does not exist, or the caller may not see it."""


class PermissionRefused(DomainError, code="permission_denied", status=403):
    """The caller may see the object but not do this to it."""


class InvalidTransition(DomainError, code="invalid_transition", status=409):
    """A transition was requested from a state that does not allow it."""

    def __init__(self, *, entity: str, entity_id: Any, current: str, requested: str, why: str = "") -> None:
        detail = f"{entity} {entity_id} is {current}; cannot {requested}"
        if why:
            detail = f"{detail}: {why}"
        super().__init__(detail, entity=entity, id=entity_id, **{"from": current, "to": requested})
        self.entity = entity
        self.entity_id = entity_id
        self.current = current
        self.requested = requested


class Conflict(DomainError, code="conflict", status=409):
    """The request contradicts the object's current state."""


class IdempotencyKeyInUse(Conflict, code="idempotency_key_in_use"):
    """The first request with this key is still running."""


class IdempotencyKeyReused(DomainError, code="idempotency_key_reused", status=422):
    """The key was used on this endpoint with another request body."""
