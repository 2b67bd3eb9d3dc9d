"""Runs one claimed job through its definition and maps every outcome onto the state machine.

Outcomes: a result → completed; ``JobCancelled`` → cancelled; a timeout or an exception →
classified by the definition (retryable → awaiting_tool with backoff, within the attempt
and failure budgets; fatal → failed); ``InsufficientCredits`` → failed with
``insufficient_credits``; an unknown type or an invalid payload → failed with
``invalid_payload``; a deadline already passed → completed with the fallback result.
"""

from __future__ import annotations

import _signal
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.utils import timezone
from django_q.exceptions import TimeoutException as QTimeout

from billing.errors import InsufficientCredits
from core.errors import DomainError, ValidationFailed
from core.tracing import traced_job
from jobs import services
from jobs.models import Job, JobReason
from jobs.registry import FatalJobError, JobCancelled, JobDefinition, JobTimeout, RetryableJobError, definition_get

logger = logging.getLogger("orchestrator.jobs")

# The job this process is executing now (read by the heartbeat thread to renew its lease).
CURRENT: dict[str, Any] = {"job_id": None, "worker": None}


@dataclass
class JobContext:
    """What a job's code sees: ids, an idempotency key, progress and a cancellation check."""

    job_id: int
    attempt: int
    worker: str
    project_id: int
    run_id: int | None
    definition: JobDefinition
    session: Any = None
    _last_check: float = field(default=0.0, repr=False)
    _cancelled: bool = field(default=False, repr=False)

    @property
    def idempotency_key(self) -> str:
        return f"job:{self.job_id}:attempt:{self.attempt}"

    def progress(self, data: dict) -> None:
        services.job_progress(job_id=self.job_id, attempt=self.attempt, progress=data)

    def should_stop(self) -> bool:
        """True once cancellation was requested (read from the database at most every 100 ms)."""
        now = time.monotonic()
        if not self._cancelled and now - self._last_check >= 0.1:
            self._last_check = now
            self._cancelled = services.job_cancel_requested(job_id=self.job_id)
        return self._cancelled

    def check_cancelled(self) -> None:
        if self.should_stop():
            raise JobCancelled(f"job {self.job_id} was cancelled")


class _AlarmDispatch:
    """SIGALRM's handler while a message's jobs run: the time limit of the job in hand raises
    ``JobTimeout``; between jobs the handler it was installed over (django-q2's message timeout) is
    called, or its default action taken. Installed once per message, so a job arms and disarms
    the timer only (``time_limit``): swapping the handlers per job cost four system calls."""

    def __init__(self, outer) -> None:
        self.outer = outer
        self.limit: float | None = None  # the job in hand's timeout (s), None between jobs

    def __call__(self, signum, frame) -> None:
        if self.limit is not None:
            limit, self.limit = self.limit, None
            raise JobTimeout(f"job exceeded its timeout of {limit:g} s")
        if callable(self.outer):
            self.outer(signum, frame)
        elif self.outer != signal.SIG_IGN:  # the default action: the process ends
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)


class time_limit:  # noqa: N801 - used as a function: ``with time_limit(seconds):``
    """Raise ``JobTimeout`` in this (main) thread after ``seconds`` (none: no limit).

    django-q2 arms its own alarm for the whole message: the job's limit is kept a second short of
    what is left of it, and it is armed again with the rest after. (A class, not a generator: it
    wraps every job.)"""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = float(seconds) if seconds else None

    def __enter__(self) -> None:
        if self.seconds is None or threading.current_thread() is not threading.main_thread():
            self.dispatch = None
            return
        # (the C function: ``signal.getsignal`` converts a handler to its enum first, by way of a
        # ValueError for any handler that is not SIG_DFL or SIG_IGN: 1.7 us a job)
        dispatch = _signal.getsignal(signal.SIGALRM)
        if not isinstance(dispatch, _AlarmDispatch):
            dispatch = _AlarmDispatch(dispatch)
            signal.signal(signal.SIGALRM, dispatch)
        self.dispatch, self.outer_remaining = dispatch, signal.getitimer(signal.ITIMER_REAL)[0]
        self.started = time.monotonic()
        limit = self.seconds
        if self.outer_remaining:
            limit = min(limit, max(self.outer_remaining - 1.0, 0.5))
        dispatch.limit = self.seconds
        signal.setitimer(signal.ITIMER_REAL, limit)

    def __exit__(self, *exc) -> None:
        if self.dispatch is None:
            return
        # The job's timer is replaced before its limit is dropped: an alarm between the two would
        # otherwise reach the outer handler (SIG_DFL: the process's end). One that fires before
        # the replacement still raises JobTimeout, as the job's own.
        outer = self.outer_remaining
        signal.setitimer(signal.ITIMER_REAL, max(1.0, outer - (time.monotonic() - self.started)) if outer else 0)
        self.dispatch.limit = None


@dataclass(frozen=True)
class Finished:
    """An attempt that returned: its result waits to be recorded (``job_complete``/``jobs_complete``)."""

    job_id: int
    attempt: int
    result: Any

    def __str__(self) -> str:
        return "completed"


def _job_execute(job: Job, *, worker: str) -> str | Finished:
    """Run a claimed job's code; a failure, cancellation or deadline is recorded at once (the
    outcome's name is returned), a result is returned as ``Finished`` for the caller to record."""
    definition = definition_get(job.type)
    attempt = job.attempts
    if definition is None:
        services.job_fail(job_id=job.pk, reason=JobReason.INVALID_PAYLOAD,
                          error=f"unknown job type {job.type!r}: no definition is registered")
        return "failed"
    try:
        payload = definition.validated(job.payload)
    except ValidationFailed as exc:
        services.job_fail(job_id=job.pk, reason=JobReason.INVALID_PAYLOAD, error=f"{exc.detail}: {exc.errors}")
        return "failed"
    except Exception as exc:  # a validator that crashed on a malformed persisted payload
        services.job_fail(job_id=job.pk, reason=JobReason.INVALID_PAYLOAD, error=f"{type(exc).__name__}: {exc}")
        return "failed"
    timeout = definition.effective_timeout_s
    if job.deadline_at is not None:
        remaining = (job.deadline_at - timezone.now()).total_seconds()
        if remaining <= 0:
            services.jobs_enforce_deadlines()
            return "fallback"
        timeout = min(timeout, remaining) if timeout else remaining
    context = JobContext(job_id=job.pk, attempt=attempt, worker=worker, project_id=job.project_id,
                         run_id=job.run_id, definition=definition)
    CURRENT.update(job_id=job.pk, worker=worker, run_id=job.run_id)
    try:
        if definition.session_agent:
            from jobs.sessions import worker_session_for_job

            context.session = worker_session_for_job(job=job, definition=definition)
        with time_limit(timeout):
            result = definition.run(context, payload)
    except JobCancelled:
        services.job_mark_cancelled(job_id=job.pk, attempt=attempt)
        return "cancelled"
    except QTimeout as exc:  # django-q2 is killing this worker (its message ran out of time)
        return services.job_fail_attempt(job_id=job.pk, attempt=attempt, error=str(exc), retryable=True,
                                         reason=JobReason.SHUTDOWN_TIMEOUT)
    except InsufficientCredits as exc:  # the organization cannot pay: nothing ran, retrying will not help
        return services.job_fail_attempt(job_id=job.pk, attempt=attempt, error=f"{type(exc).__name__}: {exc}",
                                         retryable=False, reason=JobReason.INSUFFICIENT_CREDITS)
    except JobTimeout as exc:
        if job.deadline_at is not None and job.deadline_at <= timezone.now():
            services.jobs_enforce_deadlines()
            return "fallback"
        retryable = definition.retry.classify(exc) == "retryable"
        return services.job_fail_attempt(job_id=job.pk, attempt=attempt, error=str(exc), retryable=retryable,
                                         reason=JobReason.TIMEOUT)
    except Exception as exc:
        retryable = definition.retry.classify(exc) == "retryable"
        expected = isinstance(exc, (RetryableJobError, FatalJobError, DomainError))
        logger.log(logging.INFO if expected else logging.WARNING, "job %s (%s) attempt %s raised %s: %s",
                   job.pk, job.type, attempt, type(exc).__name__, exc, exc_info=not expected)
        return services.job_fail_attempt(job_id=job.pk, attempt=attempt, error=f"{type(exc).__name__}: {exc}",
                                         retryable=retryable)
    finally:
        CURRENT.update(job_id=None, run_id=None)
    return Finished(job.pk, attempt, _jsonable(result))


@traced_job
def job_execute(job: Job, *, worker: str) -> str | Finished:
    """``_job_execute`` in the job's span (a batch's results are recorded after it)."""
    return _job_execute(job, worker=worker)


@traced_job
def job_run_claimed(job: Job, *, worker: str) -> str:
    """Execute a job this worker has claimed and record its outcome, both in the job's span;
    returns what happened to it."""
    outcome = _job_execute(job, worker=worker)
    if not isinstance(outcome, Finished):
        return outcome
    applied = services.job_complete(job_id=outcome.job_id, attempt=outcome.attempt, result=outcome.result)
    return "completed" if applied else "discarded"


# Results of a batch are recorded together at the latest this long after the first of them
# returned (a job's lane, slot and dependants wait for it).
COMPLETE_FLUSH_S = 0.02


def jobs_run_claimed(jobs: list[Job], *, worker: str) -> list[str]:
    """Execute a batch this worker claimed, in order, and record the outcomes: failures at once,
    results together (``services.jobs_complete``, one statement for several). A job whose turn
    comes late (a third of the lease after the claim) has its lease renewed first, with the
    rest of the batch; one this worker no longer holds (recovered, cancelled) is not run."""
    outcomes: dict[int, str] = {}
    pending: list[Finished] = []
    claimed_at = time.monotonic()
    renew_after = settings.ORCHESTRATOR_QUEUE_LEASE_S / 3

    def flush():
        if pending:
            done = services.jobs_complete(results=[(item.job_id, item.attempt, item.result) for item in pending])
            outcomes.update({item.job_id: "completed" if item.job_id in done else "discarded" for item in pending})
            pending.clear()

    queue = list(jobs)
    index = 0
    first_result_at = 0.0
    while index < len(queue):
        if index and time.monotonic() - claimed_at > renew_after:
            flush()
            rest = queue[index:]
            held = services.jobs_renew_leases(attempts={item.pk: item.attempts for item in rest}, worker=worker)
            outcomes.update({item.pk: "discarded" for item in rest if item.pk not in held})
            queue = queue[:index] + [item for item in rest if item.pk in held]
            claimed_at = time.monotonic()
            continue
        if pending and time.monotonic() - first_result_at >= COMPLETE_FLUSH_S:
            flush()
        job = queue[index]
        index += 1
        outcome = job_execute(job, worker=worker)
        if not isinstance(outcome, Finished):
            outcomes[job.pk] = outcome
            continue
        if not pending:
            first_result_at = time.monotonic()
        pending.append(outcome)
    flush()
    return [outcomes[job.pk] for job in jobs]




def _jsonable(value: Any) -> Any:
    import json

    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return {"repr": repr(value)}
