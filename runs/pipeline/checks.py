"""Internal gates: the registry of checks a ``check`` step names, and the built-in checks.

A check is a plain function ``fn(args: dict, ctx: CheckContext) -> CheckResult``: it reads
(never writes) and judges named invariants, each held or not; the gate passes when every
invariant holds. Checks run in dry runs too, so they must have no side effect. Adding one is
a few lines::

    @register_check("queue_empty", validate=lambda args: [])
    def queue_empty(args, ctx):
        depth = Job.objects.filter(state="queued").count()
        return CheckResult({"queue_empty": depth == 0}, {"depth": depth})
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

from django.conf import settings

# Keys the plan puts in a check step's arguments that are not the check's own.
STEP_KEYS = ("check", "gate")


@dataclass
class CheckContext:
    """What a check may see: its run, the current pins (dimension → value) and the run's mode."""

    run: Any
    pins: dict[str, Any] = field(default_factory=dict)
    mode: str = "live"


@dataclass
class CheckResult:
    """``invariants`` maps each invariant to whether it held; ``details`` the values it was judged on."""

    invariants: dict[str, bool]
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.invariants) and all(self.invariants.values())

    @property
    def broken(self) -> list[str]:
        return [name for name, held in self.invariants.items() if not held]


@dataclass(frozen=True)
class Check:
    name: str
    func: Callable[[dict, CheckContext], CheckResult]
    validate: Callable[[dict], list[str]]
    description: str = ""


CHECKS: dict[str, Check] = {}


def register_check(name: str, *, validate: Callable[[dict], list[str]] | None = None, description: str = ""):
    """Decorator that registers ``func`` as the check ``name``."""

    def decorator(func):
        CHECKS[name] = Check(name=name, func=func, validate=validate or (lambda args: []),
                             description=description or (func.__doc__ or ""))
        return func

    return decorator


def check_get(name: str) -> Check | None:
    return CHECKS.get(name)


def check_args(step_args: dict) -> dict:
    """A check step's own arguments (without the plan's ``check`` and ``gate`` keys)."""
    return {key: value for key, value in (step_args or {}).items() if key not in STEP_KEYS}


def check_evaluate(name: str, args: dict, ctx: CheckContext) -> CheckResult:
    """Run a check; an error inside it is a broken ``check_ran`` invariant (gates fail closed)."""
    check = check_get(name)
    if check is None:
        return CheckResult({"check_registered": False}, {"error": f"check {name!r} is not registered"})
    try:
        result = check.func(args, ctx)
    except Exception as exc:  # a check that cannot judge does not pass
        return CheckResult({"check_ran": False}, {"error": f"{type(exc).__name__}: {exc}"})
    if not isinstance(result, CheckResult) or not result.invariants:
        return CheckResult({"check_ran": False}, {"error": "the check judged no invariant"})
    return CheckResult({str(k): bool(v) for k, v in result.invariants.items()}, _jsonable(result.details))


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# --- file paths --------------------------------------------------------------------------------

def file_roots() -> list[str]:
    """Directories whose files checks and pins may read (``ORCHESTRATOR_PIPELINE_FILE_ROOTS``)."""
    roots = getattr(settings, "ORCHESTRATOR_PIPELINE_FILE_ROOTS", None)
    if roots is None:
        import os

        raw = os.environ.get("ORCHESTRATOR_PIPELINE_FILE_ROOTS")
        roots = [part for part in raw.split(",") if part.strip()] if raw else [str(settings.BASE_DIR / "var")]
    return [str(root) for root in roots]


def path_errors(value: Any, key: str = "path") -> list[str]:
    """Plan-time check of a file path: absolute, under an allowed root once resolved."""
    import os

    if not isinstance(value, str) or not value.strip():
        return [f"{key}: required, a file path"]
    if not os.path.isabs(value):
        return [f"{key}: must be an absolute path"]
    real = os.path.realpath(value)
    roots = [os.path.realpath(root) for root in file_roots()]
    if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots):
        return [f"{key}: must be under one of {', '.join(roots)} (ORCHESTRATOR_PIPELINE_FILE_ROOTS)"]
    return []


def file_sha256(path: str) -> str | None:
    """The file's SHA-256 (hex), or None when it is missing, unreadable or outside the roots."""
    if path_errors(path):
        return None
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


# --- built-in checks ---------------------------------------------------------------------------

def _validate_nothing(args: dict) -> list[str]:
    return []


@register_check("ledger_balanced", validate=_validate_nothing)
def ledger_balanced(args: dict, ctx: CheckContext) -> CheckResult:
    """The run's ledger so far conserves credits: its counters equal its ledger entries,
    ``reserved >= charged >= 0``, and nothing was charged or released beyond the reservation."""
    from billing.selectors import ledger_totals
    from runs.models import Run, RunAttempt

    run = Run.objects.get(pk=ctx.run.pk)
    ledger = ledger_totals(run_id=run.pk)
    counters = {"reserved": run.credits_reserved, "charged": run.credits_charged, "refunded": run.credits_refunded}
    attempts = list(RunAttempt.objects.filter(run=run).values("credits_reserved", "credits_charged",
                                                              "credits_refunded"))
    return CheckResult({
        "counters_match_ledger": counters == ledger,
        "reserved_covers_charged": ledger["reserved"] >= ledger["charged"] >= 0,
        "within_reservation": ledger["charged"] + ledger["refunded"] <= ledger["reserved"],
        "attempts_within_reservation": all(0 <= a["credits_charged"]
                                           and a["credits_charged"] + a["credits_refunded"] <= a["credits_reserved"]
                                           for a in attempts),
        "attempts_add_up": sum(a["credits_reserved"] for a in attempts) == ledger["reserved"],
    }, {"ledger": ledger, "run": counters})


def _validate_file_digest(args: dict) -> list[str]:
    errors = path_errors(args.get("path"))
    expected = args.get("sha256")
    if not isinstance(expected, str) or len(expected) != 64 or any(c not in "0123456789abcdef"
                                                                    for c in expected.lower()):
        errors.append("sha256: required, 64 hexadecimal characters")
    return errors


@register_check("file_digest", validate=_validate_file_digest)
def file_digest(args: dict, ctx: CheckContext) -> CheckResult:
    """A file's SHA-256 equals the expected one."""
    actual = file_sha256(args["path"])
    return CheckResult({"file_readable": actual is not None,
                        "sha256_matches": actual == str(args["sha256"]).lower()},
                       {"path": args["path"], "expected": str(args["sha256"]).lower(), "actual": actual})


def _validate_http_ok(args: dict) -> list[str]:
    url = args.get("url")
    try:
        parsed = urllib.parse.urlparse(url) if isinstance(url, str) else None
        valid = parsed is not None and parsed.scheme in ("http", "https") and bool(parsed.hostname)
    except ValueError:
        valid = False
    errors = [] if valid else ["url: required, an http(s) URL"]
    timeout = args.get("timeout", 5)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 30:
        errors.append("timeout: seconds, more than 0 and at most 30")
    return errors


@register_check("http_ok", validate=_validate_http_ok)
def http_ok(args: dict, ctx: CheckContext) -> CheckResult:
    """An allow-listed URL (``ORCHESTRATOR_HTTP_ALLOWED_HOSTS``) answers a GET with 2xx."""
    url = args["url"]
    host = urllib.parse.urlparse(url).hostname
    allowed = host in settings.ORCHESTRATOR_HTTP_ALLOWED_HOSTS
    status = None
    error = ""
    if allowed:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="GET"),
                                        timeout=float(args.get("timeout", 5))) as response:
                status = response.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    details = {"url": url, "status": status}
    if error:
        details["error"] = error
    return CheckResult({"host_allowed": allowed, "answered_2xx": status is not None and 200 <= status < 300},
                       details)


def _validate_expect(args: dict) -> list[str]:
    errors = []
    if "equals" not in args:
        errors.append("equals: required, the expected value")
    if ("value" in args) == ("pin" in args):
        errors.append("give exactly one of value (a value) or pin (a pin's dimension)")
    elif "pin" in args and (not isinstance(args["pin"], str) or not args["pin"].strip()):
        errors.append("pin: a pin's dimension")
    return errors


@register_check("expect", validate=_validate_expect)
def expect(args: dict, ctx: CheckContext) -> CheckResult:
    """A value, or a pin's current value, equals the expected one (for drills and pinned facts)."""
    if "pin" in args:
        known = args["pin"] in ctx.pins
        actual = ctx.pins.get(args["pin"])
        return CheckResult({"pin_recorded": known, "equals": known and actual == args["equals"]},
                           {"pin": args["pin"], "actual": actual, "expected": args["equals"]})
    return CheckResult({"equals": args["value"] == args["equals"]},
                       {"actual": args["value"], "expected": args["equals"]})
