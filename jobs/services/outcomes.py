"""An attempt's outcomes: progress, completion, failure with the retry decision, and failing a job now."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from core.services import audit_record, row_lock
from jobs.models import Job, JobReason, JobState
from jobs.registry import definition_get
from jobs.services.common import _after_commit_hook, _current, _move, _wake


def job_progress(*, job_id: int, attempt: int, progress: dict) -> bool:
    """Record progress of the current attempt (executing → executing) and renew its lease."""
    with transaction.atomic():
        job = row_lock(Job, job_id, entity="job")
        if not _current(job, attempt):
            return False
        job.progress = progress
        job.lease_expires_at = timezone.now() + timedelta(seconds=settings.ORCHESTRATOR_QUEUE_LEASE_S)
        _move(job, JobState.EXECUTING, extra={"progress": progress})
        return True


def job_complete(*, job_id: int, attempt: int, result: Any = None, reason: str = JobReason.COMPLETED) -> bool:
    """executing → completed with ``result``. A stale attempt's result is discarded (False)."""
    with transaction.atomic():
        job = row_lock(Job, job_id, entity="job")
        if not _current(job, attempt):
            return False
        job.result = result
        job.error = ""
        _move(job, JobState.COMPLETED, reason=reason)
        definition = definition_get(job.type)
        if definition is not None:
            _after_commit_hook(definition, "on_completed", job)
        return True


def job_fail_attempt(*, job_id: int, attempt: int, error: str, retryable: bool, reason: str = "") -> str:
    """Record a failed attempt and decide (seed 000 AG-ORCH-03): ``retry`` → awaiting_tool with
    a backoff ``not_before``; otherwise ``failed`` with a reason code. Returns the decision,
    or ``discarded`` for a stale attempt.
    """
    with transaction.atomic():
        job = row_lock(Job, job_id, entity="job")
        if not _current(job, attempt):
            return "discarded"
        definition = definition_get(job.type)
        job.failures += 1
        job.error = error
        if not retryable:
            final = reason or JobReason.FATAL
        elif job.attempts >= job.max_attempts:
            final = reason if reason in (JobReason.TIMEOUT, JobReason.SHUTDOWN_TIMEOUT) else JobReason.MAX_ATTEMPTS
        elif job.failures >= job.max_failures:
            final = JobReason.MAX_FAILURES
        else:
            final = ""
        if final:
            _move(job, JobState.FAILED, reason=final)
            if definition is not None:
                _after_commit_hook(definition, "on_failed", job)
            return "failed"
        delay = definition.retry.delay_ms(job.attempts) if definition else 1000
        job.not_before = timezone.now() + timedelta(milliseconds=delay)
        _move(job, JobState.AWAITING_TOOL, reason=reason or JobReason.RETRY_SCHEDULED,
              extra={"retryInMs": delay})
        transaction.on_commit(_wake)
        return "retry"


def job_fail(*, job_id: int, reason: str, error: str, actor=None, audit_reason: str = "") -> Job:
    """Fail a non-terminal job now with ``reason`` (invalid payload, operator runbook ...)."""
    with transaction.atomic():
        job = row_lock(Job, job_id, entity="job")
        if job.state == JobState.FAILED:
            return job
        before = job.state
        job.error = error
        _move(job, JobState.FAILED, reason=reason)
        if actor is not None:
            audit_record(actor=actor, action="job_fail", target_type="job", target_id=job.pk,
                         organization_id=job.organization_id, run_id=job.run_id, reason=audit_reason,
                         before={"state": before}, after={"state": job.state, "reason": reason})
        definition = definition_get(job.type)
        if definition is not None:
            _after_commit_hook(definition, "on_failed", job)
        return job


def job_retarget(*, job_id: int, attempt: int, job_type: str, project_id: int, payload: dict) -> bool:
    """Point the executing attempt of a job at new work, in the caller's transaction: its payload
    and dedupe key become those of ``payload`` (a recovered attempt then resumes that work).

    False, and nothing written, when the attempt is no longer current or an active job of the
    same type already holds the new dedupe key (that job does the work). Only the unique dedupe
    key can conflict: that one statement runs under a savepoint.
    """
    definition = definition_get(job_type)
    if definition is None:
        return False
    payload = definition.validated(payload)
    key = definition.dedupe.key(payload, project_id) if definition.dedupe.mode != "none" else None
    current = Job.objects.filter(pk=job_id, type=job_type, attempts=attempt, state=JobState.EXECUTING)
    try:
        with transaction.atomic():
            updated = current.update(payload=payload, dedupe_key=key or "",
                                     active_dedupe_key=f"{definition.type}:{key}" if key else None,
                                     updated_at=timezone.now())
    except IntegrityError:
        return False
    return updated == 1
