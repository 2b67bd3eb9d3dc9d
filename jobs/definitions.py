"""Built-in job types."""

from __future__ import annotations

from core.errors import ValidationFailed
from jobs.events import JOB_PROBE_EXECUTED
from jobs.registry import Dedupe, JobDefinition, RetryPolicy, payload_lane_errors, register


def _chosen_lane(payload: dict, project_id: int) -> str:
    """The lane the payload asks for (``lane``), which the engine namespaces under the project."""
    return payload.get("lane", "")


def _validate_noop(payload: dict) -> dict:
    problems = payload_lane_errors(payload.get("lane", ""))
    if problems:
        raise ValidationFailed("invalid payload", errors={"payload.lane": problems})
    if "sleep" in payload:
        seconds = payload["sleep"]
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 60:
            raise ValidationFailed("invalid payload", errors={"payload.sleep": ["a number of seconds from 0 to 60"]})
    return payload


def _run_noop(ctx, payload: dict):
    """Return the payload (optionally after sleeping, checking for cancellation)."""
    import time

    seconds = float(payload.get("sleep", 0))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ctx.check_cancelled()
        time.sleep(min(0.02, max(0.0, end - time.monotonic())))
    return {"echo": payload.get("value"), "attempt": ctx.attempt}


# A trivial job for benchmarks, health probes and drills. No lane (runs as wide as allowed) unless
# the payload names one, which then lives in the project's namespace (project:<id>:user:<lane>).
NOOP = register(JobDefinition(
    type="noop", run=_run_noop, validate=_validate_noop, priority_class="background",
    lane=_chosen_lane,
    dedupe=Dedupe("none"), retry=RetryPolicy(max_attempts=3),
    timeout_s=65,
))


def _run_probe(ctx, payload: dict):
    """Record one execution as an event (drills count them), then behave like ``noop``."""
    from core.services import event_record

    event_record(type=JOB_PROBE_EXECUTED, organization_id=None, project_id=ctx.project_id,
                 payload={"jobId": ctx.job_id, "attempt": ctx.attempt, "worker": ctx.worker})
    if payload.get("fail") == "fatal":
        raise ValueError("probe: fatal failure requested")
    if payload.get("fail") == "retryable" and ctx.attempt <= int(payload.get("times", 1)):
        raise ConnectionError(f"probe: retryable failure on attempt {ctx.attempt}")
    return _run_noop(ctx, payload)


# Like ``noop`` but leaves an event per execution: drills and tests count executions with it.
PROBE = register(JobDefinition(
    type="probe", run=_run_probe, validate=_validate_noop, priority_class="background",
    lane=_chosen_lane,
    dedupe=Dedupe("none"), retry=RetryPolicy(max_attempts=5, backoff="immediate_linear"),
    timeout_s=65,
))


# The ``command`` job type (seed 000 AG-EXE-01) lives with the command boundary.
from jobs.commands import job as _command_job  # noqa: E402,F401  (registers "command")
