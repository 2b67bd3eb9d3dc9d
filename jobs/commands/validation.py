"""Command names and their arguments: checked and normalized before anything is recorded.

Normalization makes the payload hash stable: defaults are filled in and decimals are written
as plain strings, so ``{"quantity": 1}`` and ``{"quantity": "1.0"}`` are the same command.
"""

from __future__ import annotations

import hashlib
import json
from decimal import Decimal, InvalidOperation
from typing import Any

from core.errors import ValidationFailed
from core.validation import text_errors
from jobs.models import CommandKind
from jobs.tools import tool_get

WRITE_COMMANDS = frozenset(CommandKind.values)
READ_OPERATIONS = frozenset({"deployment_list", "deployment_get", "order_list", "order_get"})
KEY_MAX_LENGTH = 200


def payload_hash(args: dict) -> str:
    """sha256 of the canonical JSON of ``args`` (sorted keys, no spaces, UTF-8)."""
    canonical = json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def idempotency_key_errors(key: Any) -> list[str]:
    return text_errors(key, max_length=KEY_MAX_LENGTH)


def _text(args: dict, name: str, errors: dict, *, max_length: int, required: bool = True) -> str | None:
    value = args.get(name)
    if value is None and not required:
        return None
    problems = text_errors(value, max_length=max_length)
    if problems:
        errors[name] = problems
        return None
    return value.strip()


def _identifier(args: dict, name: str, errors: dict, *, required: bool = True) -> int | None:
    value = args.get(name)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        errors[name] = ["required, a positive integer id"]
        return None
    return value


def _decimal(args: dict, name: str, errors: dict, *, required: bool = True) -> str | None:
    value = args.get(name)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        errors[name] = ["required, a positive number"]
        return None
    try:
        number = Decimal(str(value))
    except InvalidOperation:
        errors[name] = ["must be a number"]
        return None
    if not number.is_finite() or number <= 0:
        errors[name] = ["must be a positive number"]
        return None
    number = number.normalize()
    if number.as_tuple().exponent < -10 or number.adjusted() >= 18:
        errors[name] = ["at most 18 digits before and 10 after the decimal point"]
        return None
    return format(number, "f")


def _no_extra(args: dict, allowed: set[str], errors: dict) -> None:
    for name in sorted(set(args) - allowed):
        errors[name] = ["unknown argument"]


def command_args_validate(kind: Any, args: Any) -> dict:
    """Return the normalized arguments of command ``kind`` or raise ``ValidationFailed``.

    Field errors are keyed ``kind``, ``args`` or ``args.<name>``.
    """
    if kind not in WRITE_COMMANDS:
        raise ValidationFailed("unknown command", errors={
            "kind": [f"{kind!r} is not a command; one of {', '.join(sorted(WRITE_COMMANDS))}"]})
    if not isinstance(args, dict):
        raise ValidationFailed("invalid command arguments", errors={"args": ["must be a JSON object"]})
    errors: dict[str, list[str]] = {}
    normalized: dict[str, Any]
    if kind == CommandKind.CREATE_DEPLOYMENT:
        _no_extra(args, {"name", "spec"}, errors)
        spec = args.get("spec", {})
        if not isinstance(spec, dict):
            errors["spec"] = ["must be a JSON object"]
        normalized = {"name": _text(args, "name", errors, max_length=200), "spec": spec}
    elif kind == CommandKind.STOP_DEPLOYMENT:
        _no_extra(args, {"deployment_id"}, errors)
        normalized = {"deployment_id": _identifier(args, "deployment_id", errors)}
    elif kind == CommandKind.PLACE_ORDER:
        _no_extra(args, {"symbol", "side", "quantity", "price", "deployment_id"}, errors)
        side = args.get("side")
        if side not in ("buy", "sell"):
            errors["side"] = ["one of buy, sell"]
        normalized = {
            "symbol": _text(args, "symbol", errors, max_length=64),
            "side": side,
            "quantity": _decimal(args, "quantity", errors),
            "price": _decimal(args, "price", errors, required=False),
            "deployment_id": _identifier(args, "deployment_id", errors, required=False),
        }
    elif kind == CommandKind.CANCEL_ORDER:
        _no_extra(args, {"order_id"}, errors)
        normalized = {"order_id": _identifier(args, "order_id", errors)}
    else:  # invoke_tool
        normalized = _tool_args(args, errors)
    if errors:
        raise ValidationFailed("invalid command arguments",
                               errors={f"args.{name}": messages for name, messages in errors.items()})
    try:
        payload_hash(normalized)
    except (TypeError, ValueError):
        raise ValidationFailed("invalid command arguments", errors={"args": ["must be plain JSON"]}) from None
    return normalized


def _tool_args(args: dict, errors: dict) -> dict:
    _no_extra(args, {"tool", "args"}, errors)
    name = args.get("tool")
    tool_args = args.get("args", {})
    if not isinstance(tool_args, dict):
        errors["args"] = ["must be a JSON object"]
        tool_args = {}
    tool = tool_get(name) if isinstance(name, str) else None
    if tool is None:
        errors["tool"] = [f"{name!r} is not a registered tool"]
    elif "args" not in errors:
        messages = tool.validate(tool_args)
        if messages:
            errors["args"] = list(messages)
    return {"tool": name, "args": tool_args}
