"""Cancellation: cancelling a job, the worker's cooperative stop, and the graceful window's end."""

from __future__ import annotations

from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from core.services import audit_record, row_lock
from jobs.errors import JobConflict
from jobs.models import TERMINAL_JOB_STATES, Job, JobReason, JobState
from jobs.registry import definition_get
from jobs.events import JOB_PROGRESS
from jobs.services.common import _after_commit_hook, _current, _emit, _move


def job_cancel(*, job_id: int, reason: str = "", actor=None) -> Job:
    """Cancel a job. Waiting → cancelled at once; executing → cooperative stop requested (or
    cancelled at once with the ``mark_cancelled`` strategy); already cancelled → no-op;
    completed or failed → ``JobConflict`` (terminal states are immutable).
    """
    with transaction.atomic():
        job = row_lock(Job, job_id, entity="job")
        if job.state == JobState.CANCELLED:
            return job
        if job.state in TERMINAL_JOB_STATES:
            raise JobConflict(entity="job", entity_id=job.pk, current=job.state, requested="cancelled",
                              why="terminal states are immutable")
        before = job.state
        definition = definition_get(job.type)
        job.cancel_reason = reason or "cancelled"
        if job.state == JobState.EXECUTING and (definition is None or definition.cancel_strategy == "cooperative"):
            if job.cancel_requested_at is None:
                job.cancel_requested_at = timezone.now()
                job.save(update_fields=["cancel_requested_at", "cancel_reason", "updated_at"])
                _emit(job, JOB_PROGRESS, {"cancelRequested": True, "cancelReason": job.cancel_reason})
        else:
            job.cancel_requested_at = job.cancel_requested_at or timezone.now()
            _move(job, JobState.CANCELLED, reason=JobReason.CANCELLED, extra={"cancelReason": job.cancel_reason})
            if definition is not None:
                _after_commit_hook(definition, "on_cancelled", job.pk)
        if actor is not None:
            audit_record(actor=actor, action="job_cancel", target_type="job", target_id=job.pk,
                         organization_id=job.organization_id, run_id=job.run_id, reason=reason,
                         before={"state": before}, after={"state": job.state})
        return job


def job_mark_cancelled(*, job_id: int, attempt: int, reason: str = JobReason.CANCELLED) -> bool:
    """The worker stopped a cancelled job cooperatively: executing → cancelled."""
    with transaction.atomic():
        job = row_lock(Job, job_id, entity="job")
        if not _current(job, attempt):
            return False
        _move(job, JobState.CANCELLED, reason=reason, extra={"cancelReason": job.cancel_reason})
        definition = definition_get(job.type)
        if definition is not None:
            _after_commit_hook(definition, "on_cancelled", job.pk)
        return True


def job_cancel_requested(*, job_id: int) -> bool:
    return Job.objects.filter(pk=job_id, cancel_requested_at__isnull=False).exists()


def jobs_enforce_interrupt_timeouts(*, now=None) -> int:
    """Executing jobs asked to stop that did not within their graceful window end ``cancelled``
    with ``interrupt_timeout``; the lane is freed and a late result will be discarded."""
    now = now or timezone.now()
    count = 0
    candidates = Job.objects.filter(state=JobState.EXECUTING, cancel_requested_at__isnull=False)
    for job in candidates.only("pk", "type", "cancel_requested_at"):
        definition = definition_get(job.type)
        graceful = timedelta(milliseconds=definition.graceful_ms if definition else 5_000)
        if job.cancel_requested_at + graceful > now:
            continue
        with transaction.atomic():
            locked = Job.objects.select_for_update(skip_locked=True).filter(pk=job.pk).first()
            if locked is None or locked.state != JobState.EXECUTING:
                continue
            _move(locked, JobState.CANCELLED, reason=JobReason.INTERRUPT_TIMEOUT,
                  extra={"cancelReason": locked.cancel_reason})
            count += 1
    return count
