"""The tool registry and the tool call boundary: ``name → callable + cost + timeout + argument check``.

A tool is a plain function ``fn(args: dict, ctx: ToolContext) -> JSON-able result``. Raise
``RetryableToolError`` for transient failures and ``FatalToolError`` for permanent ones; any
other exception is classified fatal with its message kept. Tools are invoked only through the
execution command boundary (``jobs.commands``), by a run's steps or a ``command`` job. An app
registers its tools when it loads (``runs.tools`` holds the built-ins); adding one is a few lines::

    @register_tool("shout", cost=1, timeout_s=5)
    def shout(args, ctx):
        return {"text": str(args["text"]).upper()}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


class ToolError(Exception):
    code = "tool_error"
    retryable = False

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code:
            self.code = code


class RetryableToolError(ToolError):
    code = "retryable_error"
    retryable = True


class FatalToolError(ToolError):
    code = "fatal_error"
    retryable = False


class ToolCancelled(Exception):
    """Raised by ``ToolContext.check_cancelled`` when the run was paused or cancelled."""


# Seed 001 §6.1: error classes worth retrying.
RETRYABLE_EXCEPTION_NAMES = frozenset({
    "ConnectionError", "TimeoutError", "MemoryError", "DiskError", "LLMRateLimitError", "LLMTimeoutError",
    "LLMServiceError", "RetryableToolError", "ConnectionResetError", "ConnectionRefusedError",
})
RETRYABLE_HTTP_STATUSES = frozenset({429, 502, 503, 504})


def classify_exception(exc: BaseException) -> tuple[bool, str, str]:
    """Return ``(retryable, code, message)`` for an exception raised by a tool."""
    if isinstance(exc, ToolError):
        return exc.retryable, exc.code, str(exc)
    name = type(exc).__name__
    retryable = name in RETRYABLE_EXCEPTION_NAMES or isinstance(exc, (ConnectionError, TimeoutError))
    code = "retryable_error" if retryable else "fatal_error"
    return retryable, code, f"{name}: {exc}"


@dataclass
class ToolContext:
    """What a tool may see: the step's idempotency key and a cooperative stop check."""

    idempotency_key: str
    attempt: int = 1
    should_stop: Callable[[], bool] = lambda: False
    project_id: int | None = None

    def check_cancelled(self) -> None:
        if self.should_stop():
            raise ToolCancelled("the run was paused or cancelled")


@dataclass(frozen=True)
class Tool:
    name: str
    func: Callable[[dict, ToolContext], Any]
    cost: int
    timeout_s: float = 30.0
    validate: Callable[[dict], list[str]] = field(default=lambda args: [])
    description: str = ""


_REGISTRY: dict[str, Tool] = {}


def register_tool(name: str, *, cost: int, timeout_s: float = 30.0,
                  validate: Callable[[dict], list[str]] | None = None, description: str = ""):
    """Decorator that registers ``func`` as the tool ``name``."""
    if cost <= 0:
        raise ValueError("a tool's cost must be positive")

    def decorator(func):
        _REGISTRY[name] = Tool(name=name, func=func, cost=cost, timeout_s=timeout_s,
                               validate=validate or (lambda args: []), description=description or (func.__doc__ or ""))
        return func

    return decorator


def tool_get(name: str) -> Tool | None:
    return _REGISTRY.get(name)


def tool_names() -> list[str]:
    return sorted(_REGISTRY)
