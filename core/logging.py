"""Log lines as JSON objects, one per line (``LOG_FORMAT=json``, the default), or as text.

``JsonFormatter`` writes ``{"ts", "level", "logger", "message", ...}`` and merges the
structured fields a caller passes as ``extra={"fields": {...}}`` (state transitions do, see
``core.services.transition_log``), so a log pipeline can filter on ``run_id``, ``job_id``,
``type``, ``from``, ``to`` or ``reason`` without parsing the message.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

RESERVED = frozenset({"ts", "level", "logger", "message"})


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields attached to ``record`` (empty when it carries none)."""
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; newlines in values are escaped, so a record is one line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record_fields(record).items():
            line[f"field_{key}" if key in RESERVED else key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``LOG_FORMAT=text``: the usual line, with the structured fields as ``key=value`` pairs."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = record_fields(record)
        if fields:
            text += " " + " ".join(f"{key}={json.dumps(value, default=str)}" for key, value in fields.items())
        return text
