"""One error shape for every API response: ``{"code", "detail", ...}``.

Domain errors (``core.errors``) carry their own code, status and extra fields; DRF's and
Django's exceptions are mapped here once: validation → ``400 validation_error`` with
``errors`` keyed by field path, authentication → ``401``, permission and CSRF → ``403
permission_denied``, not found → ``404 not_found``, rate limits → ``429 rate_limited``, a body
over the size limit (ours, or Django's ``DATA_UPLOAD_MAX_MEMORY_SIZE``) → ``413
payload_too_large``, a body nested too deeply → ``400 json_too_deep`` (``max_depth``), too many query
parameters (Django's ``DATA_UPLOAD_MAX_NUMBER_FIELDS``) → ``400 validation_error``. Anything
else is a bug and stays a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response

from core.api.parsers import JsonTooDeep
from core.errors import DomainError

# DRF's default codes renamed to ours.
DRF_CODES = {
    "invalid": "validation_error",
    "parse_error": "validation_error",
    "not_authenticated": "not_authenticated",
    "authentication_failed": "authentication_failed",
    "permission_denied": "permission_denied",
    "not_found": "not_found",
    "method_not_allowed": "method_not_allowed",
    "not_acceptable": "not_acceptable",
    "unsupported_media_type": "unsupported_media_type",
    "throttled": "rate_limited",
    "payload_too_large": "payload_too_large",
}


def flatten_errors(detail: Any, prefix: str = "") -> dict[str, list[str]]:
    """DRF's nested error detail → ``{"field.sub[0].name": ["message", ...]}``."""
    errors: dict[str, list[str]] = {}
    if isinstance(detail, dict):
        for key, value in detail.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            for field, messages in flatten_errors(value, path).items():
                errors.setdefault(field, []).extend(messages)
    elif isinstance(detail, list):
        if all(not isinstance(item, (dict, list)) for item in detail):
            errors.setdefault(prefix or "non_field_errors", []).extend(str(item) for item in detail)
        else:
            for index, item in enumerate(detail):
                if item in ({}, [], None, ""):
                    continue
                for field, messages in flatten_errors(item, f"{prefix}[{index}]").items():
                    errors.setdefault(field, []).extend(messages)
    else:
        errors.setdefault(prefix or "non_field_errors", []).append(str(detail))
    return errors


def error_response(code: str, detail: str, http_status: int, *, headers: dict | None = None,
                   **extra: Any) -> Response:
    return Response({"code": code, "detail": detail, **extra}, status=http_status, headers=headers)


def api_exception_handler(exc: Exception, context: dict) -> Response | None:
    """DRF's ``EXCEPTION_HANDLER``: every handled error in the ``{"code", "detail"}`` shape."""
    if isinstance(exc, DomainError):
        headers = {}
        if exc.sends_retry_after and exc.extra.get("retry_after") is not None:
            headers["Retry-After"] = str(int(exc.extra["retry_after"]))
        return Response(exc.as_dict(), status=exc.status, headers=headers)
    if isinstance(exc, TooManyFieldsSent):
        logging.getLogger("django.security.TooManyFieldsSent").warning("%s", exc)
        return error_response("validation_error", "too many parameters", status.HTTP_400_BAD_REQUEST,
                              errors={"query": [f"at most {settings.DATA_UPLOAD_MAX_NUMBER_FIELDS} parameters "
                                                "(DATA_UPLOAD_MAX_NUMBER_FIELDS)"]})
    if isinstance(exc, RequestDataTooBig):
        from core.api.parsers import body_limit_exceeded

        exc = body_limit_exceeded(settings.DATA_UPLOAD_MAX_MEMORY_SIZE, "DATA_UPLOAD_MAX_MEMORY_SIZE")
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound(*exc.args)
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied(*exc.args)
    elif isinstance(exc, DjangoValidationError):
        exc = exceptions.ValidationError(exc.message_dict if hasattr(exc, "error_dict") else exc.messages)
    if not isinstance(exc, exceptions.APIException):
        return None
    headers = {}
    if getattr(exc, "auth_header", None):
        headers["WWW-Authenticate"] = exc.auth_header
    if getattr(exc, "wait", None):
        headers["Retry-After"] = "%d" % exc.wait
    if isinstance(exc, exceptions.ValidationError):
        return error_response("validation_error", "invalid request", status.HTTP_400_BAD_REQUEST,
                              errors=flatten_errors(exc.detail))
    if isinstance(exc, JsonTooDeep):
        return error_response("json_too_deep", str(exc.detail), status.HTTP_400_BAD_REQUEST,
                              max_depth=settings.ORCHESTRATOR_JSON_MAX_DEPTH)
    if isinstance(exc, exceptions.ParseError):
        return error_response("validation_error", "malformed request body", status.HTTP_400_BAD_REQUEST,
                              errors={"body": [str(exc.detail)]})
    code = DRF_CODES.get(exc.default_code, exc.default_code)
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    extra = {"retry_after": int(exc.wait)} if isinstance(exc, exceptions.Throttled) and exc.wait else {}
    return error_response(code, str(detail), exc.status_code, headers=headers, **extra)
