"""The API's JSON parser: a body size limit, a nesting depth limit, strict numbers and strings.

A body longer than ``ORCHESTRATOR_API_MAX_BODY_BYTES`` answers ``413 payload_too_large``
before it is parsed, whether it announced its length or not. A body nested deeper than
``ORCHESTRATOR_JSON_MAX_DEPTH`` (arrays and objects; the body itself is level 1) answers
``400 json_too_deep``, however deep it is (nothing recursive sees it). Any other malformed body
is a ``400 validation_error`` with ``errors.body``: a syntax error, bytes that are not UTF-8,
``NaN``/``Infinity``, a number that overflows to infinity (``1e400``), an integer of more than
4300 digits, a string with a lone surrogate (``"\\ud800"``, which no database can store).

``json_loads_checked`` is the same reading for other JSON entry points (the WebSocket consumer).
"""

from __future__ import annotations

import codecs
import json
import math
from typing import Any

from django.conf import settings
from rest_framework import exceptions, status
from rest_framework.parsers import JSONParser


class PayloadTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "payload_too_large"
    default_detail = "the request body is too large"


class JsonTooDeep(exceptions.APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "json_too_deep"
    default_detail = "the request body is nested too deeply"


class JsonRefused(ValueError):
    """JSON text refused by ``json_loads_checked``: ``code`` is ``json_too_deep`` or ``invalid_json``."""

    def __init__(self, code: str, detail: str, *, max_depth: int | None = None) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.max_depth = max_depth


def body_limit_exceeded(limit: int, setting: str = "ORCHESTRATOR_API_MAX_BODY_BYTES") -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is larger than {limit} bytes ({setting})")


def _constant_refused(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _too_deep(max_depth: int) -> JsonRefused:
    return JsonRefused("json_too_deep", f"JSON nested deeper than {max_depth} levels (ORCHESTRATOR_JSON_MAX_DEPTH)",
                       max_depth=max_depth)


def _has_lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _checked(value: Any, max_depth: int, surrogates: bool) -> None:
    """Walk ``value`` without recursion: its depth, and (when ``surrogates``) its strings."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > max_depth:
                raise _too_deep(max_depth)
            for key, item in node.items():
                if surrogates and _has_lone_surrogate(key):
                    raise JsonRefused("invalid_json", "a key holds a lone surrogate (not valid Unicode)")
                stack.append((item, depth + 1))
        elif isinstance(node, list):
            if depth > max_depth:
                raise _too_deep(max_depth)
            stack.extend((item, depth + 1) for item in node)
        elif surrogates and isinstance(node, str) and _has_lone_surrogate(node):
            raise JsonRefused("invalid_json", "a string holds a lone surrogate (not valid Unicode)")


def json_loads_checked(text: str, *, max_depth: int | None = None) -> Any:
    """``json.loads`` refusing what the API refuses (see the module docstring) with ``JsonRefused``."""
    max_depth = settings.ORCHESTRATOR_JSON_MAX_DEPTH if max_depth is None else max_depth
    try:
        value = json.loads(text, parse_constant=_constant_refused, parse_float=_finite_float)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError as exc:  # JSONDecodeError, our refusals, an integer of more than 4300 digits
        raise JsonRefused("invalid_json", f"JSON parse error - {exc}") from exc
    # Only a text with that many brackets can be that deep; only a \u escape can make a surrogate.
    deep = text.count("[") + text.count("{") > max_depth
    surrogates = "\\ud" in text or "\\uD" in text
    if deep or surrogates:
        _checked(value, max_depth, surrogates)
    return value


class LimitedJSONParser(JSONParser):
    """DRF's JSON parser reading at most ``ORCHESTRATOR_API_MAX_BODY_BYTES`` bytes of JSON that
    ``json_loads_checked`` accepts."""

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.ORCHESTRATOR_API_MAX_BODY_BYTES
        request = (parser_context or {}).get("request")
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        try:
            if declared and int(declared) > limit:
                raise body_limit_exceeded(limit)
        except (TypeError, ValueError):
            pass
        body = stream.read(limit + 1) if stream is not None else b""
        if len(body) > limit:
            raise body_limit_exceeded(limit)
        encoding = (parser_context or {}).get("encoding") or settings.DEFAULT_CHARSET
        try:
            text = codecs.decode(body, encoding)
        except (LookupError, ValueError) as exc:
            raise exceptions.ParseError(f"JSON parse error - the body is not valid {encoding}") from exc
        try:
            return json_loads_checked(text)
        except JsonRefused as exc:
            if exc.code == "json_too_deep":
                raise JsonTooDeep(exc.detail) from exc
            raise exceptions.ParseError(exc.detail) from exc
