"""Enqueueing: caps on waiting jobs (per project, per organization, in all) and dedupe."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models.base import ModelState
from django.utils import timezone

from core.errors import ValidationFailed
from core.inserts import insert_tree
from core.metrics import metric_sample, metrics_add
from core.models import Organization, Project
from core.services import audit_record, events_record, transition_log
from core.sql import hot_cursor, per_vendor
from core.tracing import traced, tracing_traceparent
from jobs.errors import QueueDisabled, QueueFull
from jobs.models import (NOT_STARTED_JOB_STATES, WAITING_JOB_STATES, Job, JobLane, JobState, PriorityClass,
                         index_states)
from jobs.registry import JobDefinition, definition_get
from jobs.events import JOB_PROGRESS, JOB_QUEUED
from jobs.services.common import JOB_ROWS, _after_commit_hook, _emit, _wake, job_as_dict
from jobs import wake


@dataclass(frozen=True)
class EnqueueResult:
    job: Job
    dedupe: str  # enqueued | already_queued | dropped | merged


def organization_max_waiting() -> int:
    """``ORCHESTRATOR_QUEUE_ORG_MAX_WAITING``, or when 0 half the global cap (at least the project's)."""
    return (settings.ORCHESTRATOR_QUEUE_ORG_MAX_WAITING
            or max(settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT, settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL // 2))


def _waiting_depths(project: Project, *, limits: tuple[int, int, int],
                    passing: tuple[int, int]) -> tuple[int, int, int]:
    """Jobs waiting in the project, in its organization and in all, in one prepared statement, each
    read through the index of the jobs not started (``job_not_started_scope_idx``) and counted up to
    its limit (``limits``: enough to tell whether its cap is reached), without reading a deep backlog
    further than that. The total is counted first: the project's and the organization's own counts
    are read only when the total is more than ``passing`` says passes their caps (a part of the
    total passes too, and the total stands in for its count)."""
    with hot_cursor() as cursor:
        cursor.execute(_waiting_depths_sql(), {
            "project": project.pk, "organization": project.organization_id, "project_limit": limits[0],
            "organization_limit": limits[1], "total_limit": limits[2], "project_passing": passing[0],
            "organization_passing": passing[1]})
        project_count, organization_count, total = cursor.fetchone()
    return int(project_count), int(organization_count), int(total)


@per_vendor
def _waiting_depths_sql() -> str:
    """``_waiting_depths``' statement: the states of the jobs not started written out as the index's
    condition names them (not parameters), so that a plan made once (on PostgreSQL, a generic one,
    whatever the statistics said then) reads that index; each count stops at its limit."""
    table = connection.ops.quote_name(Job._meta.db_table)
    states = index_states("job_not_started_scope_idx")
    assert set(states) == set(NOT_STARTED_JOB_STATES), "the index must hold exactly the jobs not started"
    written = ", ".join(f"'{state}'" for state in states)

    def bounded(where: str, limit: str) -> str:
        return (f"(SELECT COUNT(*) FROM (SELECT 1 FROM {table} j WHERE j.state IN ({written}){where}"
                f" LIMIT %({limit})s) AS waiting)")

    scope = " AND j.organization_id = %(organization)s"
    # (materialized: PostgreSQL would otherwise count the total again at each of its three uses)
    materialized = "MATERIALIZED " if connection.vendor == "postgresql" else ""
    return (f"WITH t AS {materialized}(SELECT {bounded('', 'total_limit')} AS total)"
            f" SELECT CASE WHEN t.total <= %(project_passing)s THEN t.total"
            f" ELSE {bounded(scope + ' AND j.project_id = %(project)s', 'project_limit')} END,"
            f" CASE WHEN t.total <= %(organization_passing)s THEN t.total"
            f" ELSE {bounded(scope, 'organization_limit')} END, t.total FROM t")


def _enqueued_attributes(result: EnqueueResult) -> dict[str, Any]:
    job = result.job
    return {"job_id": job.pk, "job_type": job.type, "run_id": job.run_id, "organization_id": job.organization_id,
            "project_id": job.project_id, "dedupe": result.dedupe}


@traced("job enqueue", result_attributes=_enqueued_attributes)
def job_enqueue(*, job_type: str, project: Project, payload: Any, source_session_id: str = "", thread_id: str = "",
                run_id: int | None = None, priority: int | None = None, not_before=None,
                actor=None) -> EnqueueResult:
    """Queue a job of a registered type (received → queued) and wake a worker after commit.

    Dedupe is enforced by a unique constraint over active jobs: ``single_flight`` returns the
    existing job (``already_queued``), ``drop_duplicate`` drops the new one (``dropped``),
    ``merge_duplicate`` merges the payload into a waiting job (``merged``). ``not_before``
    delays the job (a queued job is claimable once it has passed). The caps on waiting jobs
    (per project, per organization, in all) raise ``QueueFull`` with a retry hint; the project's
    and the organization's are exact: their rows are locked (project then organization) and the
    waiting jobs counted as the last step before the commit, so the locks that serialize one
    project's enqueues are held for two statements, not the whole enqueue. The
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
        if active_key:
            # A deduplicated type: its key is looked up under the caps' locks (duplicates see each
            # other), then the row is written.
            _caps_lock(project)
            existing = Job.objects.select_for_update().filter(active_dedupe_key=active_key).first()
            if existing is not None:
                return _dedupe_hit(definition, existing, payload)
            _caps_check(project, new=0)
        job = _new_job(definition, project, payload, lane=lane, key=key, run_id=run_id, priority=priority,
                       not_before=not_before, source_session_id=source_session_id, thread_id=thread_id)
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
        if job.lane:  # its row, once: one statement whether it exists or not
            JobLane.objects.bulk_create([JobLane(key=job.lane)], ignore_conflicts=True)
        if actor is not None:
            audit_record(actor=actor, action="job_enqueue", target_type="job", target_id=job.pk,
                         organization_id=job.organization_id, run_id=run_id, after={"type": job.type})
        if not active_key:
            # The caps last, so their locks are held for as short a time as possible: from here to
            # the commit. A cap that is reached raises, and the rollback takes every row back.
            _caps_lock(project)
            _caps_check(project, new=1)
        if not_before is None or not_before <= job.queued_at:
            wake.notify_enqueued()
        _after_commit_hook(definition, "on_queued", job.pk)
        transaction.on_commit(_wake)
        return EnqueueResult(job, "enqueued")


def _new_job(definition: JobDefinition, project: Project, payload: dict, *, lane: str, key: str | None,
             run_id: int | None, priority: int | None, not_before, source_session_id: str = "",
             thread_id: str = "") -> Job:
    """A job of ``definition`` moved received → queued (checked by the FSM), not saved yet: the row
    is inserted once, queued."""
    now = timezone.now()
    job = Job(
        type=definition.type, version=definition.version, organization_id=project.organization_id,
        project=project, priority=definition.priority if priority is None else priority,
        priority_class=definition.priority_class,
        class_rank=0 if definition.priority_class == PriorityClass.INTERACTIVE else 1,
        lane=lane, dedupe_key=key or "", active_dedupe_key=f"{definition.type}:{key}" if key else None,
        payload=payload, max_attempts=definition.max_attempts, max_failures=definition.max_failures,
        timeout_s=definition.effective_timeout_s, source_session_id=source_session_id or "",
        thread_id=thread_id or (source_session_id or ""), run_id=run_id, traceparent=tracing_traceparent(),
        queued_at=now, not_before=not_before,
        deadline_at=now + timedelta(milliseconds=definition.deadline_ms) if definition.deadline_ms else None,
    )
    job.to_queued()
    return job


# Where django-fsm's ``ConcurrentTransitionMixin`` keeps a job's states as built (its private name).
_INITIAL_STATES = "_ConcurrentTransitionMixin__initial_states"


def _new_jobs(definition: JobDefinition, project: Project, valid: list[tuple[dict, str]], *, run_id: int | None,
              priority: int | None, not_before) -> list[Job]:
    """``_new_job`` of each ``(payload, lane)`` of one call, not saved yet. The first job is built
    and moved received → queued as ``_new_job`` does (the FSM checks the move); the others are
    copies of it that differ only in what their payloads decide (the payload, the lane, the dedupe
    key), all queued at the same moment: a job built field by field and moved by the FSM cost
    about 75 µs of CPU, a bulk enqueue's largest cost per job."""
    deduped = definition.dedupe.mode != "none"

    def built(payload: dict, lane: str) -> Job:
        return _new_job(definition, project, payload, lane=lane, key=definition.dedupe.key(payload, project.pk)
                        if deduped else None, run_id=run_id, priority=priority, not_before=not_before)

    if not JOB_ROWS.plain():  # a job model that does more when built: each one built so
        return [built(payload, lane) for payload, lane in valid]
    first = built(*valid[0])
    fields = dict(first.__dict__)
    del fields["_state"]
    initial = fields.pop(_INITIAL_STATES, None)  # the FSM mixin's, one dict per job
    cache = first._state.fields_cache  # the project, as ``Job(project=project)`` left it
    jobs = [first]
    for payload, lane in valid[1:]:
        job = Job.__new__(Job)
        job.__dict__.update(fields)
        job._state = ModelState()
        job._state.fields_cache = dict(cache)
        if initial is not None:
            job.__dict__[_INITIAL_STATES] = dict(initial)
        key = definition.dedupe.key(payload, project.pk) if deduped else None
        job.payload, job.lane = payload, lane
        job.dedupe_key, job.active_dedupe_key = key or "", f"{definition.type}:{key}" if key else None
        jobs.append(job)
    return jobs


# Payloads one ``jobs_enqueue_many`` call takes at most.
ENQUEUE_MANY_MAX = 1000


def _enqueue_many_attributes(*args, job_type=None, project=None, run_id=None, **kwargs) -> dict[str, Any]:
    return {"job_type": job_type if isinstance(job_type, str) else None,
            "project_id": getattr(project, "pk", None), "run_id": run_id}


@traced("jobs enqueue many", attributes=_enqueue_many_attributes,
        result_attributes=lambda results: {"jobs": len(results)})
def jobs_enqueue_many(*, job_type: str, project: Project, payloads: list, run_id: int | None = None,
                      priority: int | None = None, not_before=None, actor=None,
                      dedupe_checked: bool = False, savepoint: bool = True) -> list[EnqueueResult]:
    """Queue several jobs of one type in one transaction: all of them or none.

    Every payload is validated first (``ValidationFailed`` names the bad ones by index; nothing
    is written). A type without dedupe is written in bulk: one INSERT of the rows, one of their
    events, one metric row, the lanes' rows in one statement, then the caps checked once for
    all of them (``QueueFull`` when they do not all fit: none is queued). A deduplicated type goes
    through ``job_enqueue`` for each payload in the same transaction (each its own dedupe
    outcome). After commit, wakes a worker per claim batch the new jobs fill, up to the
    deployment's live workers (``wake.enqueue_wake_count``). At most ``ENQUEUE_MANY_MAX`` payloads per call.

    ``dedupe_checked``: the caller holds, until its transaction ends, a lock that every writer of
    this type's dedupe keys for these payloads holds, and found no active job holding them (the run
    engine's ``run_step`` jobs, under their run's lock): a deduplicated type is written in bulk too,
    with its keys (a key held after all fails the caller's transaction, as any failed statement).
    ``savepoint=False``: no savepoint either for a type without dedupe; the caller's transaction
    fails with any error here (a cap reached among them) and is not meant to go on after one.
    """
    if not settings.ORCHESTRATOR_QUEUE_ENABLED:
        raise QueueDisabled("the job queue is disabled (ORCHESTRATOR_QUEUE_ENABLED=false)")
    definition = definition_get(job_type) if isinstance(job_type, str) else None
    if definition is None:
        raise ValidationFailed("unknown job type", errors={"type": [f"{job_type!r} is not a registered job type"]})
    if not isinstance(payloads, (list, tuple)) or not payloads:
        raise ValidationFailed("no payloads", errors={"payloads": ["a non-empty list of payloads is required"]})
    if len(payloads) > ENQUEUE_MANY_MAX:
        raise ValidationFailed("too many payloads", errors={"payloads": [
            f"at most {ENQUEUE_MANY_MAX} jobs per call ({len(payloads)} given)"]})
    valid, errors = [], {}
    for index, payload in enumerate(payloads):
        try:
            payload = definition.validated(payload)
            valid.append((payload, definition.lane_key(payload, project_id=project.pk, run_id=run_id)))
        except ValidationFailed as exc:
            errors[str(index)] = exc.errors or [exc.detail]
    if errors:
        raise ValidationFailed("invalid payloads", errors={"payloads": errors})
    if definition.dedupe.mode != "none" and not dedupe_checked:
        with transaction.atomic():
            return [job_enqueue(job_type=job_type, project=project, payload=payload, run_id=run_id, priority=priority,
                                not_before=not_before, actor=actor) for payload, _ in valid]
    # dedupe_checked or not savepoint: the caller's transaction fails with it
    with transaction.atomic(savepoint=savepoint and not dedupe_checked):
        jobs = _new_jobs(definition, project, valid, run_id=run_id, priority=priority, not_before=not_before)
        insert_tree([(jobs, None)])  # one prepared statement whatever the number of jobs
        for job in jobs:
            transition_log(entity="job", id=job.pk, project=job.project_id, run=job.run_id, type=job.type, attempt=0,
                           **{"from": JobState.RECEIVED, "to": JobState.QUEUED}, reason="enqueued")
        enqueued = metric_sample("jobs_enqueued", type=definition.type)
        enqueued.count = len(jobs)
        metrics_add([enqueued])
        events_record([{"type": JOB_QUEUED, "organization_id": job.organization_id, "project_id": job.project_id,
                        "run_id": job.run_id, "payload": job_as_dict(job)} for job in jobs])
        lanes = sorted({job.lane for job in jobs if job.lane})
        if lanes:
            JobLane.objects.bulk_create([JobLane(key=lane) for lane in lanes], ignore_conflicts=True)
        if actor is not None:
            for job in jobs:
                audit_record(actor=actor, action="job_enqueue", target_type="job", target_id=job.pk,
                             organization_id=job.organization_id, run_id=run_id, after={"type": job.type})
        _caps_lock(project)
        _caps_check(project, new=len(jobs))
        if not_before is None or not_before <= jobs[0].queued_at:
            wake.notify_enqueued()
        for job in jobs:
            _after_commit_hook(definition, "on_queued", job.pk)
        queued = len(jobs)
        transaction.on_commit(lambda: wake.wake_workers(wake.enqueue_wake_count(queued)))
        return [EnqueueResult(job, "enqueued") for job in jobs]


def _caps_lock(project: Project) -> None:
    """Serialize the enqueues of one project, then of its organization (always in that order),
    until the transaction ends: their caps on waiting jobs are exact.

    FOR NO KEY UPDATE: enqueuers wait for each other, but a transaction inserting a row that refers
    to the project (its foreign-key check takes KEY SHARE, as this enqueue's own job row did) never
    waits for an enqueue, so no deadlock forms with one that holds a lock an enqueue needs next.
    Two prepared statements, in that order."""
    with hot_cursor() as cursor:
        for sql, pk in zip(_caps_lock_sql(), (project.pk, project.organization_id)):
            cursor.execute(sql, [pk])


@per_vendor
def _caps_lock_sql() -> tuple[str, str]:
    qn = connection.ops.quote_name
    lock = " FOR NO KEY UPDATE" if connection.features.has_select_for_no_key_update else ""
    return tuple(f"SELECT 1 FROM {qn(model._meta.db_table)} WHERE id = %s{lock}" for model in (Project, Organization))


def _caps_check(project: Project, *, new: int) -> None:
    """Raise ``QueueFull`` when the project, its organization or the whole queue would hold more
    jobs waiting than its cap allows. Read under ``_caps_lock``: every earlier enqueue of the
    project and the organization has committed (or rolled back); the ``new`` jobs this
    transaction wrote are among those counted."""
    asked = max(new, 1)
    caps = (settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT, organization_max_waiting(),
            settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL)
    limits = tuple(cap + asked for cap in caps)
    # A count (the new jobs in it) passes its cap up to the cap less what is asked, plus the new; a
    # total counted to its limit may be less than the jobs waiting: it stands in for no other count.
    passing = tuple(min(cap - asked + new, limits[2] - 1) for cap in caps[:2])
    counts = _waiting_depths(project, limits=limits, passing=passing)
    depth, in_organization, total = (count - new for count in counts)
    for count, cap, scope, where in (
            (depth, caps[0], "project", f"project {project.pk} has"),
            (in_organization, caps[1], "organization", f"organization {project.organization_id} has"),
            (total, caps[2], "global", "all projects have")):
        if count + asked > cap:
            more = f" ({new} more asked for)" if new > 1 else ""
            raise QueueFull(f"{where} {count} jobs waiting (cap {cap}){more}", retry_after=_retry_hint(), scope=scope)


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
