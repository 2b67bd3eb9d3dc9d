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

import errno
import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Callable

from django.conf import settings

from runs.http_fetch import REFUSAL_CODES, FetchError, http_fetch, target_parse

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

DEFAULT_FILE_MAX_BYTES = 256 * 1024 * 1024


class PipelineFileError(Exception):
    """A file a check or pin may not read (outside the roots, the database, an artifact, too large)."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.code = code


def _default_file_root() -> str:
    return str(settings.BASE_DIR / "var" / "pipeline-files")


def file_roots() -> list[str]:
    """Directories whose files checks and pins may read (``ORCHESTRATOR_PIPELINE_FILE_ROOTS``; by
    default ``var/pipeline-files/``, created when first needed)."""
    roots = getattr(settings, "ORCHESTRATOR_PIPELINE_FILE_ROOTS", None)
    if roots is None:
        roots = [_default_file_root()]
    roots = [str(root) for root in roots]
    if _default_file_root() in roots:
        os.makedirs(_default_file_root(), exist_ok=True)
    return roots


def _protected_paths() -> tuple[set[str], list[str]]:
    """Files (the SQLite database and its sidecars) and directories (the artifacts) that no root opens."""
    files: set[str] = set()
    database = settings.DATABASES.get("default", {})
    if "sqlite" in str(database.get("ENGINE", "")):
        for name in (database.get("NAME"), getattr(settings, "SQLITE_PATH", None)):
            if name and str(name) != ":memory:":
                files.update(os.path.realpath(f"{name}{suffix}") for suffix in ("", "-wal", "-shm", "-journal"))
    directories = [getattr(settings, "ORCHESTRATOR_ARTIFACT_ROOT", None),
                   settings.STORAGES.get("artifacts", {}).get("OPTIONS", {}).get("location")]
    return files, [os.path.realpath(str(path)) for path in directories if path]


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def file_locate(value: Any) -> tuple[str, list[str]]:
    """The root (resolved) and the path's parts below it, once symlinks are resolved; a
    ``PipelineFileError`` when the path is not a readable place for checks and pins."""
    if not isinstance(value, str) or not value.strip() or "\x00" in value:
        raise PipelineFileError("required, a file path", code="invalid_path")
    if not os.path.isabs(value):
        raise PipelineFileError("must be an absolute path", code="invalid_path")
    if ".." in value.split(os.sep):
        raise PipelineFileError("must not contain '..'", code="path_not_allowed")
    real = os.path.realpath(value)
    files, directories = _protected_paths()
    if real in files or any(_within(real, directory) for directory in directories):
        raise PipelineFileError("the database and the artifacts cannot be read by checks or pins",
                                code="path_not_allowed")
    roots = [os.path.realpath(root) for root in file_roots()]
    for root in roots:
        if real != root and _within(real, root):
            return root, os.path.relpath(real, root).split(os.sep)
    if real != os.path.normpath(value):
        raise PipelineFileError(f"is a symlink leading out of {', '.join(roots)} (ORCHESTRATOR_PIPELINE_FILE_ROOTS)",
                                code="path_not_allowed")
    raise PipelineFileError(f"must be under one of {', '.join(roots)} (ORCHESTRATOR_PIPELINE_FILE_ROOTS)",
                            code="path_not_allowed")


def path_errors(value: Any, key: str = "path") -> list[str]:
    """Plan-time check of a file path: absolute, no '..', under an allowed root once resolved."""
    try:
        file_locate(value)
    except PipelineFileError as exc:
        return [f"{key}: {exc}"]
    return []


def _open_below(root: str, parts: list[str]) -> int:
    """Open ``root/parts...`` for reading one part at a time without following a symlink, so a
    path swapped for a symlink after it was checked is refused rather than followed."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    directory = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        for part in parts[:-1]:
            below = os.open(part, flags | getattr(os, "O_DIRECTORY", 0), dir_fd=directory)
            os.close(directory)
            directory = below
        # Non-blocking: opening a FIFO must not wait for a writer (it is refused just after).
        return os.open(parts[-1], flags | getattr(os, "O_NONBLOCK", 0), dir_fd=directory)
    finally:
        os.close(directory)


def file_max_bytes() -> int:
    return int(getattr(settings, "ORCHESTRATOR_PIPELINE_FILE_MAX_BYTES", DEFAULT_FILE_MAX_BYTES))


def file_sha256(path: str) -> str | None:
    """The file's SHA-256 (hex), or None while it is missing or unreadable. A path the rules refuse
    (outside the roots, the database or an artifact, a symlink out, not a regular file, over
    ``ORCHESTRATOR_PIPELINE_FILE_MAX_BYTES``) raises ``PipelineFileError`` and is never read."""
    root, parts = file_locate(path)
    try:
        descriptor = _open_below(root, parts)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PipelineFileError(f"{path} changed into a symlink", code="path_not_allowed") from exc
        return None
    cap = file_max_bytes()
    with os.fdopen(descriptor, "rb") as handle:
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise PipelineFileError(f"{path} is not a regular file", code="path_not_allowed")
        if status.st_size > cap:
            raise PipelineFileError(f"{path} is {status.st_size} bytes, over the cap of {cap} bytes "
                                    "(ORCHESTRATOR_PIPELINE_FILE_MAX_BYTES)", code="file_too_large")
        digest = hashlib.sha256()
        total = 0
        try:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                total += len(chunk)
                if total > cap:  # the file grew while it was read
                    raise PipelineFileError(f"{path} grew over the cap of {cap} bytes "
                                            "(ORCHESTRATOR_PIPELINE_FILE_MAX_BYTES)", code="file_too_large")
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
    """A file's SHA-256 equals the expected one (a file the rules refuse is not read: the reason
    is in the details)."""
    details: dict[str, Any] = {"path": args["path"], "expected": str(args["sha256"]).lower()}
    try:
        actual = file_sha256(args["path"])
    except PipelineFileError as exc:
        actual = None
        details.update(error=str(exc), code=exc.code)
    details["actual"] = actual
    return CheckResult({"file_readable": actual is not None,
                        "sha256_matches": actual == str(args["sha256"]).lower()}, details)


def _validate_http_ok(args: dict) -> list[str]:
    url = args.get("url")
    errors = []
    try:
        target_parse(url)
    except FetchError as exc:
        errors.append(f"url: required, an http(s) URL ({exc})")
    timeout = args.get("timeout", 5)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 30:
        errors.append("timeout: seconds, more than 0 and at most 30")
    return errors


@register_check("http_ok", validate=_validate_http_ok)
def http_ok(args: dict, ctx: CheckContext) -> CheckResult:
    """An allow-listed URL (``ORCHESTRATOR_HTTP_ALLOWED_HOSTS``) answers a GET with 2xx, through the
    guarded fetch (``runs.http_fetch``: addresses, redirects and the allow-list checked)."""
    url = args["url"]
    details: dict[str, Any] = {"url": url, "status": None}
    allowed = True
    try:
        result = http_fetch(url, method="GET", timeout=float(args.get("timeout", 5)), read_body=False)
        details["status"] = result.status
    except FetchError as exc:
        allowed = exc.code not in REFUSAL_CODES
        details.update(error=str(exc), code=exc.code)
    status = details["status"]
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
