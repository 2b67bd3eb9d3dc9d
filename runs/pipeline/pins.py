"""Context pins (DESIGN §4, seed 002 §8): named values a gated run depends on, and their providers.

A plan declares pins at its top (``"pins": {"manifest": {"provider": "file_sha256", "args":
{"path": "..."}}}``), recorded when the attempt begins, and a tool step may declare pins it
produces (``"pins": {...}`` on the step), recorded when the step succeeds. Before every
internal gate each current pin's provider computes the live value again; a difference is drift.
A pin is never re-recorded silently: only an operator's acknowledgment supersedes it.

A provider is ``fn(args: dict, run) -> JSON value`` (a read, never a write); adding one::

    @register_pin_provider("queue_depth", validate=lambda args: [])
    def queue_depth(args, run):
        return Job.objects.filter(project_id=run.project_id, state="queued").count()
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from django.conf import settings
from django.utils import timezone

from runs.pipeline.checks import file_sha256, path_errors

DIMENSION_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]{1,100}$")


@dataclass(frozen=True)
class PinProvider:
    name: str
    compute: Callable[[dict, Any], Any]
    validate: Callable[[dict], list[str]]


PIN_PROVIDERS: dict[str, PinProvider] = {}


def register_pin_provider(name: str, *, validate: Callable[[dict], list[str]] | None = None):
    def decorator(func):
        PIN_PROVIDERS[name] = PinProvider(name=name, compute=func, validate=validate or (lambda args: []))
        return func

    return decorator


def _validate_file(args: dict) -> list[str]:
    return path_errors(args.get("path"))


@register_pin_provider("file_sha256", validate=_validate_file)
def pin_file_sha256(args: dict, run) -> str | None:
    """The file's SHA-256 (None while it is missing, or when the file rules refuse it)."""
    return file_sha256(args["path"])


RUN_FIELDS = ("name", "priority", "failure_mode", "max_agents", "max_attempts", "credit_limit", "project_id",
              "organization_id", "mode", "plan_sha256")


def _validate_run_field(args: dict) -> list[str]:
    if args.get("field") not in RUN_FIELDS:
        return [f"field: one of {', '.join(RUN_FIELDS)}"]
    return []


@register_pin_provider("run_field", validate=_validate_run_field)
def pin_run_field(args: dict, run) -> Any:
    """A field of the run as stored now (``plan_sha256``: the digest of its plan)."""
    from runs.models import Run

    current = Run.objects.get(pk=run.pk)
    if args["field"] == "plan_sha256":
        return hashlib.sha256(json.dumps(current.plan, sort_keys=True).encode()).hexdigest()
    return getattr(current, args["field"])


SETTING_PATTERN = re.compile(r"^ORCHESTRATOR_[A-Z0-9_]+$")
SECRET_WORDS = ("SECRET", "PASSWORD", "TOKEN", "KEY")


def _validate_setting(args: dict) -> list[str]:
    name = args.get("name")
    if not isinstance(name, str) or not SETTING_PATTERN.match(name):
        return ["name: an ORCHESTRATOR_* setting"]
    if any(word in name for word in SECRET_WORDS):
        return ["name: secrets cannot be pinned"]
    return []


@register_pin_provider("setting", validate=_validate_setting)
def pin_setting(args: dict, run) -> Any:
    """An ``ORCHESTRATOR_*`` setting's current value in this process (None when unset)."""
    return _jsonable(getattr(settings, args["name"], None))


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


# --- plan-time validation ----------------------------------------------------------------------

def pins_spec_errors(spec: Any, path: str) -> dict[str, list[str]]:
    """Field errors of a ``pins`` object (dimension → {provider, args})."""
    errors: dict[str, list[str]] = {}
    if not isinstance(spec, dict):
        return {path: ["must be an object: dimension → {provider, args}"]}
    for dimension, pin in spec.items():
        where = f"{path}.{dimension}"
        if not DIMENSION_PATTERN.match(str(dimension)):
            errors.setdefault(where, []).append("a dimension name: letters, digits, _ . - (at most 100)")
        if not isinstance(pin, dict):
            errors.setdefault(where, []).append("must be an object with provider and args")
            continue
        provider = PIN_PROVIDERS.get(pin.get("provider")) if isinstance(pin.get("provider"), str) else None
        if provider is None:
            errors.setdefault(f"{where}.provider", []).append(
                f"unknown pin provider {pin.get('provider')!r}; registered: {', '.join(sorted(PIN_PROVIDERS))}")
            continue
        args = pin.get("args", {})
        if not isinstance(args, dict):
            errors.setdefault(f"{where}.args", []).append("must be an object")
            continue
        for message in provider.validate(args):
            errors.setdefault(f"{where}.args", []).append(message)
    return errors


# --- recording and verifying -------------------------------------------------------------------

def pin_compute(provider: str, args: dict, run) -> Any:
    """The provider's value now; a provider that cannot read gives ``None``."""
    found = PIN_PROVIDERS.get(provider)
    if found is None:
        return None
    try:
        return _jsonable(found.compute(args, run))
    except Exception:  # an unreadable source is a value (None) that drift detection compares
        return None


def pins_record(*, run, specs: dict, source: str) -> list:
    """Record the pins ``specs`` declares for the run's current attempt (a step's pins supersede the
    ones the same step recorded before, when a retried step succeeds again)."""
    from runs.models import ContextPin

    now = timezone.now()
    recorded = []
    for dimension, spec in (specs or {}).items():
        current = ContextPin.objects.filter(run=run, attempt_number=run.attempt_number, dimension=dimension,
                                            superseded_at__isnull=True).first()
        if current is not None:
            if current.source != source:
                continue  # declared twice (validation forbids it): the first recording stands
            current.superseded_at = now
            current.save(update_fields=["superseded_at"])
        args = dict(spec.get("args") or {})
        recorded.append(ContextPin.objects.create(
            run=run, attempt_number=run.attempt_number, dimension=dimension, provider=spec["provider"], args=args,
            value=pin_compute(spec["provider"], args, run), source=source, recorded_at=now))
    return recorded


def pins_current(run) -> dict[str, Any]:
    """The current attempt's pins: dimension → ``ContextPin``."""
    from runs.models import ContextPin

    return {pin.dimension: pin for pin in ContextPin.objects.filter(run=run, attempt_number=run.attempt_number,
                                                                      superseded_at__isnull=True)}


def pins_values(run) -> dict[str, Any]:
    return {dimension: pin.value for dimension, pin in sorted(pins_current(run).items())}


@dataclass(frozen=True)
class Drift:
    dimension: str
    recorded: Any
    live: Any


def pins_drift(run) -> list[Drift]:
    """Recompute every current pin; the ones whose live value differs from the recorded one."""
    drifts = []
    for dimension, pin in sorted(pins_current(run).items()):
        live = pin_compute(pin.provider, pin.args, run)
        if live != pin.value:
            drifts.append(Drift(dimension, pin.value, live))
    return drifts
