"""OpenAPI description of the error contract, added to every operation.

Views name the error codes an operation answers with ``errors(...)``; ``AutoSchema`` adds the
ones every operation shares (401/403/429 for authenticated operations; for POSTs the
``Idempotency-Key`` header, ``400``, ``409 idempotency_key_in_use`` and ``422
idempotency_key_reused``), so each response lists every code it can carry.
"""

from __future__ import annotations

from drf_spectacular import openapi
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import serializers
from rest_framework.permissions import AllowAny

from core.api.idempotency import HEADER, KEY_MAX_LENGTH, REPLAY_HEADER

# Every code the API answers with, and its HTTP status.
ERROR_CODES: dict[str, tuple[int, str]] = {
    "validation_error": (400, "the request is invalid; `errors` maps each field path to messages"),
    "json_too_deep": (400, "the JSON body is nested deeper than `ORCHESTRATOR_JSON_MAX_DEPTH` (`max_depth`)"),
    "not_authenticated": (401, "no credentials were given"),
    "authentication_failed": (401, "the credentials are wrong"),
    "insufficient_credits": (402, "the organization has not enough available credits"),
    "permission_denied": (403, "not allowed (including a missing or wrong CSRF token with session auth)"),
    "system_session": (403, "the worker session is system-owned: user operations are refused"),
    "not_found": (404, "no such object among the caller's organizations"),
    "invalid_transition": (409, "the object's state does not allow this action (`from`, `to`)"),
    "job_conflict": (409, "the job's state does not allow this (terminal states are immutable)"),
    "command_conflict": (409, "the command's idempotency key was recorded with another payload"),
    "approval_reused": (409, "the approval reference was already used"),
    "approval_not_pending": (409, "the run is not waiting for an approval of this gate"),
    "idempotency_key_in_use": (409, "a request with this Idempotency-Key is still in flight"),
    "artifact_expired": (410, "the artifact expired and its file was deleted"),
    "idempotency_key_reused": (422, "this Idempotency-Key was used with another request body"),
    "payload_too_large": (413, "the request body is over `ORCHESTRATOR_API_MAX_BODY_BYTES`"),
    "rate_limited": (429, "too many requests from this caller; see `Retry-After`"),
    "queue_pause_conflict": (409, "the queue is paused already (to pause) or not paused (to resume)"),
    "queue_full": (429, "the job queue is at its cap; see `Retry-After` / `retry_after`"),
    "queue_disabled": (503, "the job queue is disabled"),
}


class ErrorSerializer(serializers.Serializer):
    """Every error: a machine-readable ``code``, a human ``detail``, and fields of the code."""

    code = serializers.CharField()
    detail = serializers.CharField()
    errors = serializers.DictField(child=serializers.ListField(child=serializers.CharField()), required=False,
                                   help_text="validation_error: messages by field path")

    class Meta:
        ref_name = "Error"


class ErrorResponse(OpenApiResponse):
    def __init__(self, codes):
        self.codes = list(dict.fromkeys(codes))
        description = " | ".join(f"`{code}`: {ERROR_CODES[code][1]}" for code in self.codes)
        super().__init__(response=ErrorSerializer, description=description)


def errors(*codes: str) -> dict[int, ErrorResponse]:
    """``extend_schema(responses={200: X, **errors("not_found", "invalid_transition")})``."""
    by_status: dict[int, list[str]] = {}
    for code in codes:
        by_status.setdefault(ERROR_CODES[code][0], []).append(code)
    return {status: ErrorResponse(group) for status, group in by_status.items()}


class AutoSchema(openapi.AutoSchema):
    def _is_public(self) -> bool:
        return any(permission is AllowAny for permission in getattr(self.view, "permission_classes", []))

    def get_override_parameters(self):
        parameters = list(super().get_override_parameters())
        if self.method == "POST":
            parameters.append(OpenApiParameter(
                HEADER, OpenApiTypes.STR, OpenApiParameter.HEADER, required=False,
                description=f"Makes the POST safe to retry for 24 h: the same key and body answer the "
                            f"stored response (with `{REPLAY_HEADER}: true`); 1-{KEY_MAX_LENGTH} "
                            f"printable ASCII characters."))
        parameters.append(OpenApiParameter("Retry-After", OpenApiTypes.INT, OpenApiParameter.HEADER,
                                           response=[429], description="seconds to wait before retrying"))
        return parameters

    def _get_response_bodies(self, direction="response"):
        # Not get_response_serializers: @extend_schema replaces that method on a subclass.
        bodies = super()._get_response_bodies(direction)
        common = []
        if not self._is_public():
            common += ["not_authenticated", "authentication_failed", "permission_denied", "rate_limited"]
        if self.method == "POST":
            common += ["validation_error", "json_too_deep", "payload_too_large", "idempotency_key_in_use", "idempotency_key_reused"]
        for status, response in errors(*common).items():
            code = str(status)
            if code not in bodies:
                bodies[code] = self._get_response_for_code(response, code, direction=direction)
                continue
            description = bodies[code].get("description") or ""
            new = [part for part in response.description.split(" | ") if part not in description]
            bodies[code]["description"] = " | ".join(filter(None, [description, *new]))
        return dict(sorted(bodies.items()))


def list_retrieve_schema(serializer, *, list_summary: str, list_description: str, retrieve_summary: str,
                         retrieve_description: str, item_serializer=None, filtered: bool = True, **actions):
    """``extend_schema_view`` of a viewset that lists ``serializer`` rows (with filters: a bad filter
    is ``validation_error``, an object the caller may not see ``not_found``) and retrieves one
    (``not_found``); ``actions`` describe its other actions."""
    list_errors = ("validation_error", "not_found") if filtered else ("not_found",)
    return extend_schema_view(
        list=extend_schema(description=list_description, summary=list_summary,
                           responses={200: serializer(many=True), **errors(*list_errors)}),
        retrieve=extend_schema(description=retrieve_description, summary=retrieve_summary,
                               responses={200: item_serializer or serializer, **errors("not_found")}),
        **actions,
    )
