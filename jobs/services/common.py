"""What every job service shares: the job's API form, the move that writes a transition
(FSM check, timestamps, transition log, event), the row lock, the after-commit definition hooks
and the worker wake-up. A move writes no metric row: the queue's counters are derived from the
job table when scraped (``jobs.counters``).
"""

from __future__ import annotations

from typing import Any

from django.db import connection, transaction
from django.utils import timezone
from django_fsm import can_proceed

from core.errors import ValidationFailed
from core.services import event_record, row_lock, transition_log
from core.sql import ModelRows
from core.timefmt import isoformat_or_none
from jobs.errors import JobConflict
from jobs.events import JOB_PROGRESS, JOB_STATE_EVENTS
from jobs.models import TERMINAL_JOB_STATES, Job, JobState
from jobs.registry import JobDefinition



def job_as_dict(job: Job) -> dict[str, Any]:
    """A job in seed 003's field names (API resources and event payloads)."""
    data = {
        "jobId": job.pk,
        "projectId": job.project_id,
        "jobType": job.type,
        "state": job.state,
        "reason": job.reason,
        "priority": job.priority_class,
        "lane": job.lane,
        "attempts": job.attempts,
        "maxAttempts": job.max_attempts,
        "createdAt": isoformat_or_none(job.created_at),
        "startedAt": isoformat_or_none(job.started_at),
        "completedAt": isoformat_or_none(job.completed_at),
        "error": job.error or None,
        "result": job.result,
    }
    if job.source_session_id:
        data["sourceSessionId"] = job.source_session_id
    if job.thread_id:
        data["threadId"] = job.thread_id
    if job.run_id:
        data["runId"] = job.run_id
    return data


def _emit(job: Job, event_type: str, extra: dict | None = None) -> None:
    payload = job_as_dict(job)
    payload.update(extra or {})
    event_record(type=event_type, organization_id=job.organization_id, project_id=job.project_id, run_id=job.run_id,
                 payload=payload)


def _move(job: Job, target: str, *, reason: str = "", emit: bool = True, extra: dict | None = None) -> None:
    """Apply ``current → target`` through the FSM or raise ``JobConflict``."""
    before = job.state
    method = getattr(job, f"to_{target}")
    if not can_proceed(method):
        raise JobConflict(entity="job", entity_id=job.pk, current=job.state, requested=target)
    method()
    now = timezone.now()
    job.reason = reason
    if target in TERMINAL_JOB_STATES:
        job.completed_at = now
        job.active_dedupe_key = None
    if target != JobState.EXECUTING:
        job.slot = None
        job.organization_slot = None
        job.lease_expires_at = None
    job.save()
    transition_log(entity="job", id=job.pk, project=job.project_id, run=job.run_id, type=job.type,
                   attempt=job.attempts, **{"from": before, "to": target}, reason=reason)
    if emit:
        event_type = JOB_STATE_EVENTS.get(target, JOB_PROGRESS) if before != target else JOB_PROGRESS
        _emit(job, event_type, extra)


def job_transition(*, job_id: int, target: str, reason: str = "") -> Job:
    """Move a job to ``target`` under its row lock, following seed 000's matrix exactly.

    A self-transition of a terminal state is a no-op; every move outside the matrix raises
    ``JobConflict`` and changes nothing.
    """
    if target not in JobState.values:
        raise ValidationFailed("unknown job state", errors={"state": [f"{target!r} is not a job state"]})
    with transaction.atomic():
        job = row_lock(Job, job_id, entity="job")
        if job.state == target and target in TERMINAL_JOB_STATES:
            return job
        _move(job, target, reason=reason)
        return job


def _after_commit_hook(definition: JobDefinition, hook_name: str, job_id: int) -> None:
    """Call the definition's hook with the job as it is once the transaction committed (at once
    outside one)."""
    hook = getattr(definition, hook_name)
    if hook is None:
        return

    def call():
        fresh = Job.objects.filter(pk=job_id).first()
        if fresh is not None:
            hook(fresh)

    transaction.on_commit(call)


def _wake() -> None:
    from jobs.wake import wake_workers

    wake_workers()


JOB_ROWS = ModelRows(Job)


def _job_columns() -> str:
    """``RETURNING`` columns of a job row, qualified by the table (``_jobs_from_rows`` reads them)."""
    return JOB_ROWS.columns(connection.ops.quote_name(Job._meta.db_table))


def _jobs_from_rows(rows) -> list[Job]:
    """Job instances from rows of ``_job_columns()`` (the database's values converted as the ORM does)."""
    return [JOB_ROWS.load(row) for row in rows]


def _trace_fields(traceparent: str) -> dict[str, str]:
    """A batched transition's log line written outside the job's span: the trace id of the span
    the job continues (its ``traceparent``'s), so the line joins the job's trace."""
    parts = traceparent.split("-") if traceparent else []
    return {"trace_id": parts[1]} if len(parts) == 4 else {}


def _current(job: Job, attempt: int) -> bool:
    return job.state == JobState.EXECUTING and job.attempts == attempt
