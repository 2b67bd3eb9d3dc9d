"""Recovery and leases: requeueing a stuck job, lease renewal, lost workers and deadlines."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.services import audit_record, row_lock
from jobs.errors import JobConflict
from jobs.models import ACTIVE_JOB_STATES, WAITING_JOB_STATES, Job, JobReason, JobState
from jobs.registry import definition_get
from jobs.services.common import _after_commit_hook, _move, _wake


def job_requeue(*, job_id: int, actor=None, reason: str = "") -> Job:
    """Runbook: put a stuck executing job back to wait (executing → awaiting_tool, now)."""
    with transaction.atomic():
        job = row_lock(Job, job_id, entity="job")
        if job.state in WAITING_JOB_STATES:
            return job
        if job.state != JobState.EXECUTING:
            raise JobConflict(entity="job", entity_id=job.pk, current=job.state, requested="requeue",
                              why="only executing jobs can be requeued")
        job.not_before = timezone.now()
        job.worker = ""
        _move(job, JobState.AWAITING_TOOL, reason=JobReason.LEASE_EXPIRED)
        if actor is not None:
            audit_record(actor=actor, action="job_requeue", target_type="job", target_id=job.pk,
                         organization_id=job.organization_id, run_id=job.run_id, reason=reason,
                         before={"state": JobState.EXECUTING}, after={"state": job.state})
        transaction.on_commit(_wake)
        return job


def job_renew_lease(*, job_id: int, worker: str) -> bool:
    """Heartbeat of an executing job's worker: push its lease forward (no state change)."""
    return bool(Job.objects.filter(pk=job_id, state=JobState.EXECUTING, worker=worker).update(
        lease_expires_at=timezone.now() + timedelta(seconds=settings.ORCHESTRATOR_QUEUE_LEASE_S)))


def jobs_recover_expired(*, now=None) -> int:
    """Executing jobs whose lease expired (their worker died) wait again with attempts counted,
    or fail with ``recovery_exhausted`` when no attempt is left."""
    now = now or timezone.now()
    count = 0
    ids = list(Job.objects.filter(state=JobState.EXECUTING, lease_expires_at__lt=now).values_list("pk", flat=True))
    for job_id in ids:
        with transaction.atomic():
            job = Job.objects.select_for_update(skip_locked=True).filter(pk=job_id).first()
            if job is None or job.state != JobState.EXECUTING or job.lease_expires_at is None \
                    or job.lease_expires_at >= now:
                continue
            job.worker = ""
            if job.attempts >= job.max_attempts:
                job.error = job.error or "worker lost and no attempt left"
                _move(job, JobState.FAILED, reason=JobReason.RECOVERY_EXHAUSTED)
                definition = definition_get(job.type)
                if definition is not None:
                    _after_commit_hook(definition, "on_failed", job.pk)
            else:
                job.not_before = timezone.now()  # eligible again at once
                _move(job, JobState.AWAITING_TOOL, reason=JobReason.LEASE_EXPIRED)
            count += 1
    return count


def jobs_enforce_deadlines(*, now=None) -> int:
    """Jobs past their deadline complete with the definition's deterministic fallback result."""
    now = now or timezone.now()
    count = 0
    ids = list(Job.objects.filter(state__in=list(ACTIVE_JOB_STATES), deadline_at__lt=now)
               .values_list("pk", flat=True))
    for job_id in ids:
        with transaction.atomic():
            job = Job.objects.select_for_update(skip_locked=True).filter(pk=job_id).first()
            if job is None or job.is_terminal:
                continue
            definition = definition_get(job.type)
            fallback = definition.fallback(job.payload) if definition and definition.fallback else None
            if job.state != JobState.EXECUTING:
                # Waiting → completed is not in the matrix: pass through executing (both moves
                # are checked by the FSM; the row is stored once, so no lane or slot is taken).
                if job.state == JobState.RECEIVED:
                    job.to_queued()
                job.to_executing()
            job.cancel_requested_at = job.cancel_requested_at or now  # interrupt the worker best-effort
            job.result = {"fallback": True, "value": fallback}
            _move(job, JobState.COMPLETED, reason=JobReason.FALLBACK)
            count += 1
    return count
