"""The only writers of jobs: enqueue, claim, complete, fail, cancel, recover.

Every service locks the job row before changing it and moves the state only through the
FSM transitions of ``jobs.models.Job`` (seed 000's matrix). A result or failure reported for
an attempt that is no longer current (the job was cancelled, recovered or finished meanwhile)
is discarded, never applied. django-q2 messages are sent only after commit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Count, F, Q, Subquery
from django.utils import timezone
from django_fsm import can_proceed

from core.errors import NotFound, ValidationFailed
from core.metrics import metric_observation, metric_sample, metrics_add
from core.models import Organization, Project
from core.services import audit_record, event_record, transition_log
from jobs.errors import JobConflict, QueueDisabled, QueueFull
from jobs.events import JOB_PROGRESS, JOB_QUEUED, JOB_STATE_EVENTS
from jobs.models import (
    ACTIVE_JOB_STATES,
    NOT_STARTED_JOB_STATES,
    TERMINAL_JOB_STATES,
    WAITING_JOB_STATES,
    Job,
    JobLane,
    JobReason,
    JobState,
    PriorityClass,
)
from jobs.registry import JobDefinition, definition_get


@dataclass(frozen=True)
class EnqueueResult:
    job: Job
    dedupe: str  # enqueued | already_queued | dropped | merged


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
        "createdAt": job.created_at.isoformat() if job.created_at else None,
        "startedAt": job.started_at.isoformat() if job.started_at else None,
        "completedAt": job.completed_at.isoformat() if job.completed_at else None,
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
    _move_metrics(job, before, target)
    transition_log(entity="job", id=job.pk, project=job.project_id, run=job.run_id, type=job.type,
                   attempt=job.attempts, **{"from": before, "to": target}, reason=reason)
    if emit:
        event_type = JOB_STATE_EVENTS.get(target, JOB_PROGRESS) if before != target else JOB_PROGRESS
        _emit(job, event_type, extra)


def _move_metrics(job: Job, before: str, target: str) -> None:
    """The queue's counters for one move (``core.metrics``), in the move's transaction."""
    if before == target:
        return
    samples = []
    if target == JobState.EXECUTING:
        samples.append(metric_sample("job_attempts", type=job.type))
        if job.attempts > 1:
            samples.append(metric_sample("job_retries", type=job.type))
        elif job.started_at and (job.queued_at or job.created_at):
            samples.append(metric_observation("job_wait_seconds",
                                              (job.started_at - (job.queued_at or job.created_at)).total_seconds(),
                                              type=job.type, priority=job.priority_class))
    elif target in TERMINAL_JOB_STATES:
        samples.append(metric_sample("job_finished", type=job.type, state=target, reason=job.reason))
        if job.started_at and job.completed_at:
            samples.append(metric_observation("job_run_seconds", (job.completed_at - job.started_at).total_seconds(),
                                              type=job.type, state=target))
    metrics_add(samples)


def job_transition(*, job_id: int, target: str, reason: str = "") -> Job:
    """Move a job to ``target`` under its row lock, following seed 000's matrix exactly.

    A self-transition of a terminal state is a no-op; every move outside the matrix raises
    ``JobConflict`` and changes nothing.
    """
    if target not in JobState.values:
        raise ValidationFailed("unknown job state", errors={"state": [f"{target!r} is not a job state"]})
    with transaction.atomic():
        job = _lock(job_id)
        if job.state == target and target in TERMINAL_JOB_STATES:
            return job
        _move(job, target, reason=reason)
        return job


def _lock(job_id: int) -> Job:
    try:
        return Job.objects.select_for_update().get(pk=job_id)
    except (Job.DoesNotExist, ValueError, TypeError) as exc:
        raise NotFound(f"job {job_id} does not exist") from exc


def _after_commit_hook(definition: JobDefinition, hook_name: str, job: Job) -> None:
    hook = getattr(definition, hook_name)
    if hook is None:
        return
    job_id = job.pk

    def call():
        fresh = Job.objects.filter(pk=job_id).first()
        if fresh is not None:
            hook(fresh)

    transaction.on_commit(call)


def organization_max_waiting() -> int:
    """``ORCHESTRATOR_QUEUE_ORG_MAX_WAITING``, or when 0 half the global cap (at least the project's)."""
    return (settings.ORCHESTRATOR_QUEUE_ORG_MAX_WAITING
            or max(settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT, settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL // 2))


def organization_max_executing() -> int:
    """``ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING``, or when 0 the global concurrency."""
    return settings.ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING or settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY


def _waiting_depth(**filters) -> int:
    return Job.objects.filter(state__in=NOT_STARTED_JOB_STATES, **filters).count()


def job_enqueue(*, job_type: str, project: Project, payload: Any, source_session_id: str = "", thread_id: str = "",
                run_id: int | None = None, priority: int | None = None, not_before=None,
                actor=None) -> EnqueueResult:
    """Queue a job of a registered type (received → queued) and wake a worker after commit.

    Dedupe is enforced by a unique constraint over active jobs: ``single_flight`` returns the
    existing job (``already_queued``), ``drop_duplicate`` drops the new one (``dropped``),
    ``merge_duplicate`` merges the payload into a waiting job (``merged``). ``not_before``
    delays the job (a queued job is claimable once it has passed). The caps on waiting jobs
    (per project, per organization, in all) raise ``QueueFull`` with a retry hint; the project's
    and the organization's are exact (their rows are locked, project then organization). The
    lane comes from the definition (``JobDefinition.lane_key``): an engine lane built from
    ``project`` and ``run_id``, or a lane the payload chose inside the project's namespace.
    Invalid input raises ``ValidationFailed``; nothing is written.
    """
    if not settings.ORCHESTRATOR_QUEUE_ENABLED:
        raise QueueDisabled("the job queue is disabled (ORCHESTRATOR_QUEUE_ENABLED=false)")
    definition = definition_get(job_type) if isinstance(job_type, str) else None
    if definition is None:
        raise ValidationFailed("unknown job type", errors={"type": [f"{job_type!r} is not a registered job type"]})
    payload = definition.validated(payload)
    lane = definition.lane_key(payload, project_id=project.pk, run_id=run_id)
    key = definition.dedupe.key(payload, project.pk) if definition.dedupe.mode != "none" else None
    active_key = f"{definition.type}:{key}" if key else None
    with transaction.atomic():
        # Serializes enqueues of one project: its cap is exact and duplicates see each other.
        Project.objects.select_for_update().filter(pk=project.pk).first()
        # Then of one organization (always after the project: one lock order): its cap is exact.
        Organization.objects.select_for_update().filter(pk=project.organization_id).first()
        if active_key:
            existing = Job.objects.select_for_update().filter(active_dedupe_key=active_key).first()
            if existing is not None:
                return _dedupe_hit(definition, existing, payload)
        depth = _waiting_depth(project=project)
        if depth >= settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT:
            raise QueueFull(f"project {project.pk} has {depth} jobs waiting (cap "
                            f"{settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT})", retry_after=_retry_hint(), scope="project")
        in_organization = _waiting_depth(organization_id=project.organization_id)
        if in_organization >= organization_max_waiting():
            raise QueueFull(f"organization {project.organization_id} has {in_organization} jobs waiting (cap "
                            f"{organization_max_waiting()})", retry_after=_retry_hint(), scope="organization")
        total = _waiting_depth()
        if total >= settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL:
            raise QueueFull(f"{total} jobs waiting in all projects (cap {settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL})",
                            retry_after=_retry_hint(), scope="global")
        now = timezone.now()
        interactive = definition.priority_class == PriorityClass.INTERACTIVE
        job = Job(
            type=definition.type, version=definition.version, organization_id=project.organization_id,
            project=project, priority=definition.priority if priority is None else priority,
            priority_class=definition.priority_class, class_rank=0 if interactive else 1,
            lane=lane, dedupe_key=key or "", active_dedupe_key=active_key,
            payload=payload, max_attempts=definition.max_attempts, max_failures=definition.max_failures,
            timeout_s=definition.effective_timeout_s, source_session_id=source_session_id or "",
            thread_id=thread_id or (source_session_id or ""), run_id=run_id,
            deadline_at=now + timedelta(milliseconds=definition.deadline_ms) if definition.deadline_ms else None,
        )
        job.queued_at = now
        job.not_before = not_before
        job.to_queued()  # received → queued, checked by the FSM; the row is inserted once, queued
        try:
            if active_key:
                with transaction.atomic():
                    job.save()
            else:
                job.save()
        except IntegrityError:
            # A concurrent enqueue of the same dedupe key won: answer with it.
            existing = Job.objects.select_for_update().filter(active_dedupe_key=active_key).first()
            if existing is None:
                raise
            return _dedupe_hit(definition, existing, payload)
        transition_log(entity="job", id=job.pk, project=job.project_id, run=job.run_id, type=job.type, attempt=0,
                       **{"from": JobState.RECEIVED, "to": JobState.QUEUED}, reason="enqueued")
        metrics_add([metric_sample("jobs_enqueued", type=job.type)])
        _emit(job, JOB_QUEUED)
        if job.lane:
            JobLane.objects.get_or_create(key=job.lane)
        if actor is not None:
            audit_record(actor=actor, action="job_enqueue", target_type="job", target_id=job.pk,
                         organization_id=job.organization_id, run_id=run_id, after={"type": job.type})
        _after_commit_hook(definition, "on_queued", job)
        transaction.on_commit(_wake)
        return EnqueueResult(job, "enqueued")


def _dedupe_hit(definition: JobDefinition, existing: Job, payload: dict) -> EnqueueResult:
    result = _dedupe_outcome(definition, existing, payload)
    metrics_add([metric_sample("job_dedupe_hits", type=definition.type, outcome=result.dedupe)])
    return result


def _dedupe_outcome(definition: JobDefinition, existing: Job, payload: dict) -> EnqueueResult:
    mode = definition.dedupe.mode
    if mode == "single_flight":
        return EnqueueResult(existing, "already_queued")
    if mode == "merge_duplicate" and existing.state in (JobState.RECEIVED, *WAITING_JOB_STATES):
        existing.payload = definition.validated(definition.dedupe.merge(existing.payload, payload))
        existing.save(update_fields=["payload", "updated_at"])
        _emit(existing, JOB_PROGRESS, {"merged": True})
        return EnqueueResult(existing, "merged")
    if mode == "merge_duplicate":
        return EnqueueResult(existing, "already_queued")
    return EnqueueResult(existing, "dropped")


def _retry_hint() -> int:
    """Seconds to wait before enqueueing again: roughly one default job duration."""
    return max(1, min(60, settings.ORCHESTRATOR_QUEUE_DEFAULT_TIMEOUT_MS // 10_000))


def _wake() -> None:
    from jobs.wake import wake_workers

    wake_workers()


# --- claiming -----------------------------------------------------------------------------

def jobs_eligible(now):
    """Jobs that may be claimed now: waiting, past ``not_before``, their lane idle, their
    organization below its cap of executing jobs (``organization_max_executing``)."""
    busy_lanes = Job.objects.filter(state=JobState.EXECUTING).exclude(lane="").values("lane")
    busy_organizations = (Job.objects.filter(state=JobState.EXECUTING).order_by().values("organization_id")
                          .annotate(n=Count("id")).filter(n__gte=organization_max_executing())
                          .values("organization_id"))
    return (Job.objects.filter(state__in=list(WAITING_JOB_STATES))
            .filter(Q(not_before__isnull=True) | Q(not_before__lte=now))
            .exclude(lane__in=Subquery(busy_lanes))
            .exclude(organization_id__in=Subquery(busy_organizations)))


def _free_slots() -> list[int]:
    used = set(Job.objects.filter(state=JobState.EXECUTING).values_list("slot", flat=True))
    return [slot for slot in range(settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY) if slot not in used]


def _free_organization_slots(organization_id: int) -> list[int]:
    used = set(Job.objects.filter(state=JobState.EXECUTING, organization_id=organization_id)
               .values_list("organization_slot", flat=True))
    return [slot for slot in range(organization_max_executing()) if slot not in used]


def jobs_claim_order(now) -> tuple:
    """The claim order as querysets (the definition ``_pick`` follows): aged background jobs of a
    lane that ran ``MAX_INTERACTIVE_BURST`` interactive jobs in a row, oldest first; then every
    eligible job by priority, interactive before background, FIFO."""
    eligible = jobs_eligible(now)
    aging = now - timedelta(milliseconds=settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS)
    saturated = JobLane.objects.filter(interactive_streak__gte=settings.ORCHESTRATOR_QUEUE_MAX_INTERACTIVE_BURST)
    aged = (eligible.filter(priority_class=PriorityClass.BACKGROUND, queued_at__lte=aging,
                            lane__in=Subquery(saturated.values("key")))
            .order_by("queued_at", "id"))
    return aged, eligible.order_by("priority", "class_rank", "id")


_PICK_SQL: dict[tuple[str, bool], str] = {}


def _pick_sql(*, aged: bool) -> str:
    """``jobs_claim_order`` in SQL, built once per process: compiling the two ORM queries cost
    the claim several times what the database spent running them (2.1 ms against 0.3 ms a pick)."""
    key = (connection.vendor, aged)
    if key not in _PICK_SQL:
        qn = connection.ops.quote_name
        job, lane = qn(Job._meta.db_table), qn(JobLane._meta.db_table)
        waiting = ", ".join(["%s"] * len(WAITING_JOB_STATES))
        sql = (f"SELECT * FROM {job} WHERE {qn('state')} IN ({waiting})"
               f" AND ({qn('not_before')} IS NULL OR {qn('not_before')} <= %s)"
               f" AND NOT ({qn('lane')} IN (SELECT b.{qn('lane')} FROM {job} b"
               f" WHERE b.{qn('state')} = %s AND NOT (b.{qn('lane')} = %s)))"
               f" AND NOT ({qn('organization_id')} IN (SELECT o.{qn('organization_id')} FROM {job} o"
               f" WHERE o.{qn('state')} = %s GROUP BY o.{qn('organization_id')} HAVING COUNT(*) >= %s))")
        if aged:
            sql += (f" AND {qn('lane')} IN (SELECT l.{qn('key')} FROM {lane} l WHERE l.{qn('interactive_streak')} >= %s)"
                    f" AND {qn('priority_class')} = %s AND {qn('queued_at')} <= %s"
                    f" ORDER BY {qn('queued_at')}, {qn('id')}")
        else:
            sql += f" ORDER BY {qn('priority')}, {qn('class_rank')}, {qn('id')}"
        sql += " LIMIT 1"
        if connection.features.has_select_for_update_skip_locked:
            sql += " FOR UPDATE SKIP LOCKED"
        _PICK_SQL[key] = sql
    return _PICK_SQL[key]


def _pick(now) -> Job | None:
    """The first job of ``jobs_claim_order``, locked (``SKIP LOCKED``: another worker's pick is passed over)."""
    adapt = connection.ops.adapt_datetimefield_value
    eligible = [*sorted(state.value for state in WAITING_JOB_STATES), adapt(now), JobState.EXECUTING.value, "",
                JobState.EXECUTING.value, organization_max_executing()]
    aging = now - timedelta(milliseconds=settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS)
    aged = [*eligible, settings.ORCHESTRATOR_QUEUE_MAX_INTERACTIVE_BURST, PriorityClass.BACKGROUND.value, adapt(aging)]
    for sql, params in ((_pick_sql(aged=True), aged), (_pick_sql(aged=False), eligible)):
        found = list(Job.objects.raw(sql, params))
        if found:
            return found[0]
    return None


def job_claim(*, worker: str, now=None) -> Job | None:
    """Claim the best eligible job for ``worker`` (``SELECT ... FOR UPDATE SKIP LOCKED``).

    Order: aged background jobs of a lane that ran ``MAX_INTERACTIVE_BURST`` interactive jobs
    in a row first, then lower ``priority``, interactive before background, FIFO. A job is
    eligible when waiting, past ``not_before``, its lane idle, a concurrency slot free and its
    organization below its cap of executing jobs (``organization_max_executing``; an organization
    at its cap is passed over: its jobs stay queued and another organization's take the slot).
    The lane, slot and organization-slot limits are unique constraints, so a lost race is
    retried, never doubled.
    """
    for _ in range(8):
        now = now or timezone.now()
        slots = _free_slots()
        if not slots:
            return None
        try:
            with transaction.atomic():
                job = _pick(now)
                if job is None:
                    return None
                organization_slots = _free_organization_slots(job.organization_id)
                if not organization_slots:  # the organization reached its cap since the pick: look again
                    now = None
                    continue
                job.attempts += 1
                job.slot = random.choice(slots)
                job.organization_slot = random.choice(organization_slots)
                job.worker = worker
                job.not_before = None
                job.started_at = job.started_at or now
                job.lease_expires_at = now + timedelta(seconds=settings.ORCHESTRATOR_QUEUE_LEASE_S)
                _move(job, JobState.EXECUTING)
                if job.lane:
                    if job.priority_class == PriorityClass.INTERACTIVE:
                        JobLane.objects.filter(key=job.lane).update(interactive_streak=F("interactive_streak") + 1)
                    else:
                        JobLane.objects.filter(key=job.lane).update(interactive_streak=0)
                definition = definition_get(job.type)
                if definition is not None:
                    _after_commit_hook(definition, "on_started", job)
                return job
        except IntegrityError:
            now = None
            continue
    return None


# --- outcomes -----------------------------------------------------------------------------

def _current(job: Job, attempt: int) -> bool:
    return job.state == JobState.EXECUTING and job.attempts == attempt


def job_progress(*, job_id: int, attempt: int, progress: dict) -> bool:
    """Record progress of the current attempt (executing → executing) and renew its lease."""
    with transaction.atomic():
        job = _lock(job_id)
        if not _current(job, attempt):
            return False
        job.progress = progress
        job.lease_expires_at = timezone.now() + timedelta(seconds=settings.ORCHESTRATOR_QUEUE_LEASE_S)
        _move(job, JobState.EXECUTING, extra={"progress": progress})
        return True


def job_complete(*, job_id: int, attempt: int, result: Any = None, reason: str = JobReason.COMPLETED) -> bool:
    """executing → completed with ``result``. A stale attempt's result is discarded (False)."""
    with transaction.atomic():
        job = _lock(job_id)
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
        job = _lock(job_id)
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
        job = _lock(job_id)
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


def job_cancel(*, job_id: int, reason: str = "", actor=None) -> Job:
    """Cancel a job. Waiting → cancelled at once; executing → cooperative stop requested (or
    cancelled at once with the ``mark_cancelled`` strategy); already cancelled → no-op;
    completed or failed → ``JobConflict`` (terminal states are immutable).
    """
    with transaction.atomic():
        job = _lock(job_id)
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
                _after_commit_hook(definition, "on_cancelled", job)
        if actor is not None:
            audit_record(actor=actor, action="job_cancel", target_type="job", target_id=job.pk,
                         organization_id=job.organization_id, run_id=job.run_id, reason=reason,
                         before={"state": before}, after={"state": job.state})
        return job


def job_mark_cancelled(*, job_id: int, attempt: int, reason: str = JobReason.CANCELLED) -> bool:
    """The worker stopped a cancelled job cooperatively: executing → cancelled."""
    with transaction.atomic():
        job = _lock(job_id)
        if not _current(job, attempt):
            return False
        _move(job, JobState.CANCELLED, reason=reason, extra={"cancelReason": job.cancel_reason})
        definition = definition_get(job.type)
        if definition is not None:
            _after_commit_hook(definition, "on_cancelled", job)
        return True


def job_requeue(*, job_id: int, actor=None, reason: str = "") -> Job:
    """Runbook: put a stuck executing job back to wait (executing → awaiting_tool, now)."""
    with transaction.atomic():
        job = _lock(job_id)
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


def job_cancel_requested(*, job_id: int) -> bool:
    return Job.objects.filter(pk=job_id, cancel_requested_at__isnull=False).exists()


# --- recovery -----------------------------------------------------------------------------

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
                    _after_commit_hook(definition, "on_failed", job)
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


def queue_depth() -> dict[str, Any]:
    """Waiting and executing jobs, globally, per project and per lane/type (for status views)."""
    waiting = Job.objects.filter(state__in=list(WAITING_JOB_STATES))
    return {
        "waiting": waiting.count(),
        "executing": Job.objects.filter(state=JobState.EXECUTING).count(),
        "by_project": {row["project_id"]: row["n"] for row in
                       waiting.values("project_id").annotate(n=Count("id")).order_by()},
        "by_lane_type": [dict(row) for row in
                         waiting.values("lane", "type").annotate(n=Count("id")).order_by("lane", "type")],
    }
