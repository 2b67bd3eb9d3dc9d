"""Checks of input values that every app's validators share (each returns messages, empty when fine)."""

from __future__ import annotations

from typing import Any


def text_errors(value: Any, *, max_length: int) -> list[str]:
    """A required text: a string that is not blank, of at most ``max_length`` characters."""
    if not isinstance(value, str) or not value.strip():
        return ["required, a non-empty string"]
    if len(value) > max_length:
        return [f"at most {max_length} characters"]
    return []
