"""The ``JobDefinition`` registry (seed 003): no job runs outside it.

A definition declares a job type once: its payload validation, dedupe policy, retry policy
(attempt and failure budgets, retryable/fatal classification, backoff), timeout, optional
deadline with a deterministic fallback result, cancel strategy, lane and hooks::

    register(JobDefinition(
        type="reindex", run=reindex, validate=validate_reindex,
        priority_class="background", dedupe=Dedupe("drop_duplicate", key=lambda p, project: p["index"]),
    ))

Lanes belong to the engine: a definition names the kind of lane its jobs run in (``"project"``,
``"run"`` or ``"none"``) and the engine builds the key from what it trusts (the job's project,
the run it was enqueued for), never from the payload. A definition may instead let its jobs
choose a lane (a callable of the payload): the name chosen is checked (a string of at most
``PAYLOAD_LANE_MAX_LENGTH`` characters, no control characters) and always namespaced under the
job's project (``project:<id>:user:<name>``), so no payload can name, and so block, a run's or a
project's lane or another project's lanes.
"""

from __future__ import annotations

import random
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Callable

from django.conf import settings

from core.errors import ValidationFailed

DEDUPE_MODES = ("single_flight", "drop_duplicate", "merge_duplicate", "none")
ENGINE_LANES = ("project", "run", "none")  # built by the engine from the job's project / run
PAYLOAD_LANE_MAX_LENGTH = 100  # "project:<id>:user:" + name stays within Job.lane's 200 characters
BACKOFF_STRATEGIES = ("exponential", "immediate_linear")
# Seed 001 §6.1's backoff, the one rule for job retries and step retries: 100 ms · 2^n, capped at
# 30 s, ±10 % jitter (n = retries before this one).
BACKOFF_BASE_MS = 100
BACKOFF_CAP_MS = 30_000
BACKOFF_JITTER = 0.1


def backoff_uncapped_ms(retry: int, *, base_ms: int = BACKOFF_BASE_MS) -> int:
    """The nominal delay before retry number ``retry`` (1 = the first retry), before the cap and jitter."""
    return base_ms * (2 ** max(0, retry - 1))


def backoff_ms(retry: int, *, base_ms: int = BACKOFF_BASE_MS, cap_ms: int = BACKOFF_CAP_MS, jitter: bool = True,
               rng: random.Random | None = None) -> int:
    """The delay before retry number ``retry`` (1 = the first retry): capped, then jittered by ±10 %."""
    delay = min(backoff_uncapped_ms(retry, base_ms=base_ms), cap_ms)
    if jitter:
        delay += delay * BACKOFF_JITTER * (2 * (rng or random).random() - 1)
    return max(0, int(delay))


class RetryableJobError(Exception):
    """A transient failure: retried within the attempt and failure budgets."""

    code = "retryable_error"


class FatalJobError(Exception):
    """A permanent failure: the job fails at once with ``fatal_error``."""

    code = "fatal_error"


class JobTimeout(Exception):
    """The job ran past its definition's timeout."""


class JobCancelled(Exception):
    """Raised by ``JobContext.check_cancelled`` when cancellation was requested."""


RETRYABLE_NAMES = frozenset({"ConnectionError", "TimeoutError", "JobTimeout", "RetryableJobError",
                             "RetryableToolError", "OperationalError", "InterfaceError"})


def classify_default(exc: BaseException) -> str:
    """``retryable`` for transient classes (network, timeouts, database hiccups), else ``fatal``."""
    if getattr(exc, "retryable", None) is True:
        return "retryable"
    if getattr(exc, "retryable", None) is False:
        return "fatal"
    names = {klass.__name__ for klass in type(exc).__mro__}
    return "retryable" if names & RETRYABLE_NAMES else "fatal"


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int | None = None  # None: ORCHESTRATOR_QUEUE_MAX_ATTEMPTS
    max_failures: int | None = None  # None: same as max_attempts
    classify: Callable[[BaseException], str] = classify_default
    backoff: str = "exponential"
    base_delay_ms: int = BACKOFF_BASE_MS
    max_delay_ms: int = BACKOFF_CAP_MS
    step_ms: int = 60  # immediate_linear: 0, 60, 120 ...
    jitter: bool = True

    def delay_ms(self, attempt: int, *, rng: random.Random | None = None) -> int:
        """Delay before retry number ``attempt`` (1 = the first retry)."""
        if self.backoff == "immediate_linear":
            return min(self.step_ms * (attempt - 1), self.max_delay_ms)
        return backoff_ms(attempt, base_ms=self.base_delay_ms, cap_ms=self.max_delay_ms, jitter=self.jitter, rng=rng)


@dataclass(frozen=True)
class Dedupe:
    mode: str = "none"
    key: Callable[[dict, int], str | None] = lambda payload, project_id: None
    merge: Callable[[dict, dict], dict] | None = None


def _no_validation(payload: dict) -> dict:
    return payload


def payload_lane_errors(name: Any) -> list[str]:
    """Why ``name`` cannot be a lane chosen by a payload (empty: it can; ``""`` means no lane)."""
    if not isinstance(name, str):
        return ["a string"]
    if len(name) > PAYLOAD_LANE_MAX_LENGTH:
        return [f"at most {PAYLOAD_LANE_MAX_LENGTH} characters (got {len(name)})"]
    if any(unicodedata.category(char).startswith("C") for char in name):
        return ["no control, format or unassigned characters"]
    return []


def project_lane_key(project_id: int) -> str:
    return f"project:{project_id}"


def run_lane_key(run_id: int) -> str:
    return f"run:{run_id}"


def payload_lane_key(project_id: int, name: str) -> str:
    """The lane a payload chose, inside its project's namespace (never an engine lane)."""
    return f"project:{project_id}:user:{name}" if name else ""


@dataclass(frozen=True)
class JobDefinition:
    type: str
    run: Callable[["Any", dict], Any]
    version: int = 1
    priority_class: str = "background"
    priority: int = 100
    validate: Callable[[dict], dict] = _no_validation
    dedupe: Dedupe = field(default_factory=Dedupe)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    timeout_s: float | None = None  # None: ORCHESTRATOR_QUEUE_DEFAULT_TIMEOUT_MS
    deadline_ms: int | None = None
    fallback: Callable[[dict], Any] | None = None
    cancel_strategy: str = "cooperative"  # or "mark_cancelled"
    graceful_ms: int = 5_000
    # "project" (one job of the type's project lane at a time), "run" (the lane of the run the
    # job is enqueued for), "none", or a callable ``(payload, project_id) -> name`` of a lane
    # the job chooses, namespaced under its project (see the module docstring).
    lane: str | Callable[[dict, int], str] = "project"
    session_agent: str | None = None  # run inside the owner::agent worker session
    # Runs long (a chain of steps): claimed only at the head of a batch, so no job waits behind it in
    # one worker's batch while another worker idles.
    claim_alone: bool = False
    # Shares the workers between runs: among waiting jobs of one priority and class, a job whose run
    # has a job executing (of any type) yields its place to the jobs of other runs, so two workers
    # take two runs rather than two branches of one run that then wait on each other for the run's
    # lock. Priority and class still come first, and a run's own jobs keep their FIFO order.
    spread_runs: bool = False
    bootstrap_key: str | None = None
    on_queued: Callable | None = None
    on_started: Callable | None = None
    on_completed: Callable | None = None
    on_failed: Callable | None = None
    on_cancelled: Callable | None = None

    def __post_init__(self):
        if self.dedupe.mode not in DEDUPE_MODES:
            raise ValueError(f"{self.type}: dedupe mode must be one of {DEDUPE_MODES}")
        if self.dedupe.mode == "merge_duplicate" and self.dedupe.merge is None:
            raise ValueError(f"{self.type}: merge_duplicate needs a merge function")
        if self.retry.backoff not in BACKOFF_STRATEGIES:
            raise ValueError(f"{self.type}: backoff must be one of {BACKOFF_STRATEGIES}")
        if self.priority_class not in ("interactive", "background"):
            raise ValueError(f"{self.type}: priority_class must be interactive or background")
        if self.deadline_ms is not None and self.fallback is None:
            raise ValueError(f"{self.type}: a deadline needs a deterministic fallback result")
        if not callable(self.lane) and self.lane not in ENGINE_LANES:
            raise ValueError(f"{self.type}: lane must be one of {ENGINE_LANES} or a callable naming a lane "
                             f"inside the job's project")

    @property
    def max_attempts(self) -> int:
        return self.retry.max_attempts or settings.ORCHESTRATOR_QUEUE_MAX_ATTEMPTS

    @property
    def max_failures(self) -> int:
        return self.retry.max_failures or self.max_attempts

    @property
    def effective_timeout_s(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        return settings.ORCHESTRATOR_QUEUE_DEFAULT_TIMEOUT_MS / 1000

    def lane_key(self, payload: dict, *, project_id: int, run_id: int | None) -> str:
        """The lane of a job of this type: an engine lane built from ``project_id``/``run_id``, or
        the lane the payload chose inside the project's namespace. A bad choice raises
        ``ValidationFailed`` naming ``payload.lane``."""
        if self.lane == "project":
            return project_lane_key(project_id)
        if self.lane == "run":
            if run_id is None:
                raise ValidationFailed("missing run", errors={"run": [f"{self.type} jobs run in their run's lane"]})
            return run_lane_key(run_id)
        if self.lane == "none":
            return ""
        try:
            name = self.lane(payload, project_id)
        except Exception as exc:  # a lane function tripping over a malformed payload: bad input
            raise ValidationFailed("invalid payload", errors={
                "payload.lane": [f"rejected by the {self.type} lane ({type(exc).__name__})"]}) from exc
        name = "" if name is None else name
        problems = payload_lane_errors(name)
        if problems:
            raise ValidationFailed("invalid payload", errors={"payload.lane": problems})
        return payload_lane_key(project_id, name)

    def validated(self, payload: Any) -> dict:
        if not isinstance(payload, dict):
            raise ValidationFailed("invalid payload", errors={"payload": ["must be a JSON object"]})
        result = self.validate(payload)
        return payload if result is None else result


_REGISTRY: dict[str, JobDefinition] = {}


def register(definition: JobDefinition) -> JobDefinition:
    _REGISTRY[definition.type] = definition
    return definition


def definition_get(job_type: str) -> JobDefinition | None:
    return _REGISTRY.get(job_type)


def definition_types() -> list[str]:
    return sorted(_REGISTRY)


def spread_runs_types() -> tuple[str, ...]:
    """The registered types whose jobs share the workers between runs (``JobDefinition.spread_runs``)."""
    return tuple(sorted(name for name, definition in _REGISTRY.items() if definition.spread_runs))


def claim_alone_types() -> tuple[str, ...]:
    """The registered types claimed only at the head of a batch (``JobDefinition.claim_alone``)."""
    return tuple(sorted(name for name, definition in _REGISTRY.items() if definition.claim_alone))
