"""The built-in tools (DESIGN §2.2): ``echo``, ``sleep``, ``http_request`` (allow-listed hosts),
``fail`` (for drills) and ``deploy``. They register in the tool registry (``jobs.tools``) when the
runs app loads.
"""

from __future__ import annotations

import time

from jobs.tools import RETRYABLE_HTTP_STATUSES, FatalToolError, RetryableToolError, ToolContext, register_tool
from runs.http_fetch import FetchError, http_fetch, target_parse


def _validate_echo(args: dict) -> list[str]:
    return [] if isinstance(args.get("text"), str) else ["text: required, a string"]


@register_tool("echo", cost=1, timeout_s=5, validate=_validate_echo)
def echo(args: dict, ctx: ToolContext) -> dict:
    """Return the text it was given."""
    return {"text": args["text"]}


def _validate_sleep(args: dict) -> list[str]:
    seconds = args.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return ["seconds: required, a number"]
    if not 0 <= seconds <= 3600:
        return ["seconds: must be between 0 and 3600"]
    return []


@register_tool("sleep", cost=1, timeout_s=3600, validate=_validate_sleep)
def sleep(args: dict, ctx: ToolContext) -> dict:
    """Wait ``seconds``, checking for pause or cancel every 50 ms."""
    deadline = time.monotonic() + float(args["seconds"])
    while True:
        ctx.check_cancelled()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return {"slept": args["seconds"]}
        time.sleep(min(0.05, remaining))


def _validate_http(args: dict) -> list[str]:
    errors = []
    url = args.get("url")
    if not isinstance(url, str):
        errors.append("url: required, a string")
    else:
        try:
            target_parse(url)
        except FetchError as exc:
            errors.append(f"url: must be an http(s) URL ({exc})")
    method = args.get("method", "GET")
    if method not in ("GET", "POST", "PUT", "DELETE", "HEAD"):
        errors.append("method: one of GET, POST, PUT, DELETE, HEAD")
    timeout = args.get("timeout", 10)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 30:
        errors.append("timeout: seconds, more than 0 and at most 30")
    return errors


@register_tool("http_request", cost=2, timeout_s=30, validate=_validate_http)
def http_request(args: dict, ctx: ToolContext) -> dict:
    """Call an allow-listed URL (``ORCHESTRATOR_HTTP_ALLOWED_HOSTS``) through the guarded fetch
    (``runs.http_fetch``): 10 s timeout, body capped, redirects re-checked."""
    url = args["url"]
    try:
        result = http_fetch(url, method=args.get("method", "GET"), headers={"Idempotency-Key": ctx.idempotency_key},
                            timeout=min(float(args.get("timeout", 10)), 30))
    except FetchError as exc:
        raise (RetryableToolError if exc.retryable else FatalToolError)(str(exc), code=exc.code) from exc
    if result.status >= 400:
        error_class = RetryableToolError if result.status in RETRYABLE_HTTP_STATUSES else FatalToolError
        raise error_class(f"HTTP {result.status} from {result.url}", code=f"http_{result.status}")
    return {"status": result.status, "body": result.body.decode("utf-8", "replace")}


def _validate_fail(args: dict) -> list[str]:
    errors = []
    if args.get("mode", "retryable") not in ("retryable", "fatal"):
        errors.append("mode: one of retryable, fatal")
    times = args.get("times", 1)
    if isinstance(times, bool) or not isinstance(times, int) or times < 0:
        errors.append("times: a whole number, zero or more")
    return errors


@register_tool("fail", cost=1, timeout_s=5, validate=_validate_fail)
def fail(args: dict, ctx: ToolContext) -> dict:
    """Fail the first ``times`` attempts (``retryable`` or ``fatal``), then succeed. For drills."""
    mode = args.get("mode", "retryable")
    if mode == "fatal":
        raise FatalToolError("drill: fatal failure", code="drill_fatal")
    if ctx.attempt <= int(args.get("times", 1)):
        raise RetryableToolError(f"drill: retryable failure {ctx.attempt}", code="drill_retryable")
    return {"attempt": ctx.attempt}


def _validate_deploy(args: dict) -> list[str]:
    name = args.get("name")
    return [] if isinstance(name, str) and name.strip() and len(name) <= 200 else ["name: required, a string"]


@register_tool("deploy", cost=2, timeout_s=30, validate=_validate_deploy)
def deploy(args: dict, ctx: ToolContext) -> dict:
    """Create a deployment through the execution adapter, keyed by the step attempt: replaying
    the attempt returns the same deployment instead of creating a second one."""
    from jobs.commands.adapters import adapter_get

    if ctx.project_id is None:
        raise FatalToolError("deploy needs a project", code="no_project")
    return adapter_get().create_deployment(project_id=ctx.project_id, idempotency_key=ctx.idempotency_key,
                                           name=args["name"], spec=dict(args.get("spec") or {}))
