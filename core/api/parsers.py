"""The API's JSON parser, with a body size limit (plans and job payloads arrive in bodies).

A body longer than ``ORCHESTRATOR_API_MAX_BODY_BYTES`` answers ``413 payload_too_large``
before it is parsed, whether it announced its length or not; a body nested too deeply to
parse is a ``400 validation_error`` like any other malformed body.
"""

from __future__ import annotations

import codecs
import json

from django.conf import settings
from rest_framework import exceptions, status
from rest_framework.parsers import JSONParser
from rest_framework.utils.json import strict_constant


class PayloadTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "payload_too_large"
    default_detail = "the request body is too large"


def body_limit_exceeded(limit: int, setting: str = "ORCHESTRATOR_API_MAX_BODY_BYTES") -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is larger than {limit} bytes ({setting})")


class LimitedJSONParser(JSONParser):
    """DRF's JSON parser reading at most ``ORCHESTRATOR_API_MAX_BODY_BYTES`` bytes."""

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
            return json.loads(text, parse_constant=strict_constant if self.strict else None)
        except ValueError as exc:
            raise exceptions.ParseError(f"JSON parse error - {exc}") from exc
        except RecursionError as exc:
            raise exceptions.ParseError("JSON parse error - nested too deeply") from exc
