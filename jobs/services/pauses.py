"""Pausing and resuming a queue: a project's jobs, or every job of one type.

A pause is a ``QueuePause`` row; the claim statement passes over the jobs of a paused queue
(``jobs.services.claim``), so they stay queued in their order while enqueueing goes on, and a
run whose jobs are there waits. Resuming deletes the row and wakes the workers.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction

from core.errors import NotFound, ValidationFailed
from core.models import Project
from core.services import actor_label, audit_record, event_record
from core.timefmt import isoformat_or_none
from jobs.errors import QueuePauseConflict
from jobs.events import QUEUE_PAUSED, QUEUE_RESUMED
from jobs.models import QueuePause
from jobs.registry import definition_get
from jobs.services.common import _wake


def _queue(*, project_id: int | None, job_type: str) -> tuple[Project | None, str]:
    """The locked project (or ``None``) and the job type of the queue named; bad names raise."""
    job_type = (job_type or "").strip()
    if (project_id is None) == (not job_type):
        raise ValidationFailed("name one queue", errors={"queue": ["give a project or a job type (one of them)"]})
    if job_type:
        if definition_get(job_type) is None:
            raise ValidationFailed("unknown job type", errors={"job_type": [f"{job_type!r} is not a registered "
                                                                            "job type"]})
        return None, job_type
    project = Project.objects.select_for_update(no_key=True).filter(pk=project_id).first()
    if project is None:
        raise NotFound(f"project {project_id} does not exist")
    return project, ""


def _record(pause: QueuePause, *, event_type: str, action: str, actor, reason: str) -> None:
    project = pause.project
    organization_id = project.organization_id if project is not None else None
    payload = {"projectId": pause.project_id, "jobType": pause.job_type, "actor": actor_label(actor),
               "reason": reason, "since": isoformat_or_none(pause.since)}
    event_record(type=event_type, organization_id=organization_id, project_id=pause.project_id, payload=payload)
    audit_record(actor=actor, action=action, target_type="project" if project is not None else "job_type",
                 target_id=pause.project_id or pause.job_type, organization_id=organization_id, reason=reason,
                 before={"paused": action == "queue_resume"}, after={"paused": action == "queue_pause"})


def queue_pause(*, project_id: int | None = None, job_type: str = "", actor, reason: str) -> QueuePause:
    """Pause a project's queue or a job type's: from the commit on, no claim takes its jobs
    (jobs already executing finish). Pausing a paused queue raises ``QueuePauseConflict``."""
    reason = (reason or "").strip()
    if not reason:
        raise ValidationFailed("a reason is required", errors={"reason": ["must not be empty"]})
    with transaction.atomic():
        project, job_type = _queue(project_id=project_id, job_type=job_type)
        existing = QueuePause.objects.filter(project=project) if project else QueuePause.objects.filter(
            job_type=job_type)
        known = existing.first()
        if known is not None:
            raise QueuePauseConflict(f"the queue of {known.queue} is already paused by {known.actor_label} since "
                                     f"{known.since.isoformat()}: {known.reason}")
        try:
            with transaction.atomic():
                pause = QueuePause.objects.create(project=project, job_type=job_type, reason=reason,
                                                  actor=actor if getattr(actor, "pk", None) else None,
                                                  actor_label=actor_label(actor))
        except IntegrityError:  # a concurrent pause of the same job type won
            raise QueuePauseConflict(f"the queue of job type {job_type} is already paused") from None
        _record(pause, event_type=QUEUE_PAUSED, action="queue_pause", actor=actor, reason=reason)
        return pause


def queue_resume(*, project_id: int | None = None, job_type: str = "", actor, reason: str) -> QueuePause:
    """Resume a paused queue: its jobs are claimed again in their order (workers are woken after
    commit). Returns the pause that ended; resuming a queue that is not paused raises
    ``QueuePauseConflict``."""
    reason = (reason or "").strip()
    if not reason:
        raise ValidationFailed("a reason is required", errors={"reason": ["must not be empty"]})
    with transaction.atomic():
        project, job_type = _queue(project_id=project_id, job_type=job_type)
        rows = QueuePause.objects.select_for_update()
        pause = (rows.filter(project=project) if project else rows.filter(job_type=job_type)).first()
        if pause is None:
            what = f"project {project.pk}" if project else f"job type {job_type}"
            raise QueuePauseConflict(f"the queue of {what} is not paused")
        pause.delete()
        _record(pause, event_type=QUEUE_RESUMED, action="queue_resume", actor=actor, reason=reason)
        transaction.on_commit(_wake)
        return pause
