"""Claiming: which jobs are eligible (lanes, organization caps), the claim order, and the claim
of a batch of jobs in one statement (``jobs_claim``; SQL built once per process in ``claim_sql``)."""

from __future__ import annotations

import contextlib
import logging
import weakref
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Case, Count, Exists, F, OuterRef, Q, Subquery, Value, When
from django.utils import timezone

from core.services import events_record, transition_log
from core.sql import hot_cursor, prepared_at_once
from jobs.events import JOB_STATE_EVENTS
from jobs.models import Job, JobLane, JobState, PriorityClass, QueuePause, index_states
from jobs.registry import definition_get, spread_runs_types
from jobs.services.claim_sql import CLAIM_LOCK_KEY, LOCK_SQL, RESTORE_SQL, claim_sql, events_inline, fresh_sql
from jobs.services.common import _after_commit_hook, _jobs_from_rows, _trace_fields, job_as_dict

logger = logging.getLogger("orchestrator.jobs")


def organization_max_executing() -> int:
    """``ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING``, or when 0 the global concurrency."""
    return settings.ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING or settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY


def jobs_eligible(now):
    """Jobs that may be claimed now: waiting, past ``not_before``, their lane idle, their
    organization below its cap of executing jobs (``organization_max_executing``), neither their
    project's queue nor their type's paused (``QueuePause``)."""
    busy_lanes = Job.objects.filter(state=JobState.EXECUTING).exclude(lane="").values("lane")
    busy_organizations = (Job.objects.filter(state=JobState.EXECUTING).order_by().values("organization_id")
                          .annotate(n=Count("id")).filter(n__gte=organization_max_executing())
                          .values("organization_id"))
    return (Job.objects.filter(state__in=index_states("job_claim_order_idx"))  # as the claim index names them
            .filter(Q(not_before__isnull=True) | Q(not_before__lte=now))
            .exclude(lane__in=Subquery(busy_lanes))
            .exclude(organization_id__in=Subquery(busy_organizations))
            .exclude(Exists(QueuePause.objects.filter(Q(project_id=OuterRef("project_id"))
                                                      | Q(job_type=OuterRef("type"))))))


def jobs_claim_order(now) -> tuple:
    """The claim order as querysets (the definition ``_pick`` follows): aged background jobs of a
    lane that ran ``MAX_INTERACTIVE_BURST`` interactive jobs in a row, oldest first; then every
    eligible job by priority, interactive before background, FIFO, where a job of a type that shares
    the workers between runs (``spread_runs``) whose run has a job executing comes after the others of
    its priority and class (the claim looks that far ahead among its first candidates only)."""
    eligible = jobs_eligible(now)
    aging = now - timedelta(milliseconds=settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS)
    saturated = JobLane.objects.filter(interactive_streak__gte=settings.ORCHESTRATOR_QUEUE_MAX_INTERACTIVE_BURST)
    aged = (eligible.filter(priority_class=PriorityClass.BACKGROUND, queued_at__lte=aging,
                            lane__in=Subquery(saturated.values("key")))
            .order_by("queued_at", "id"))
    spread = spread_runs_types()
    busy_run = Case(When(Q(type__in=spread) & Exists(Job.objects.filter(run_id=OuterRef("run_id"),
                                                                          state=JobState.EXECUTING)), then=Value(1)),
                    default=Value(0)) if spread else Value(0)
    return aged, eligible.annotate(busy_run=busy_run).order_by("priority", "class_rank", "busy_run", "id")


def job_claim(*, worker: str, now=None) -> Job | None:
    """Claim the best eligible job for ``worker``: ``jobs_claim`` with a batch of one."""
    claimed = jobs_claim(worker=worker, limit=1, now=now)
    return claimed[0] if claimed else None


def jobs_claim(*, worker: str, limit: int, now=None) -> list[Job]:
    """Claim up to ``limit`` eligible jobs for ``worker`` in one statement, in claim order.

    Order: aged background jobs of a lane that ran ``MAX_INTERACTIVE_BURST`` interactive jobs
    in a row first (oldest first), then lower ``priority``, interactive before background, FIFO;
    among the candidates of one priority and class, a job of a ``spread_runs`` type whose run has a
    job executing after the others (two workers take two runs, not two branches of one run).
    A job is eligible when waiting, past ``not_before``, its queue not paused (``queue_pause``:
    neither its project's nor its type's), its lane idle, a concurrency slot free and its
    organization below its cap of executing jobs (``organization_max_executing``; an organization
    at its cap is passed over: its jobs stay queued and another organization's take the slot).
    Within the batch too: at most one job per lane, at most the free global slots and each
    organization's free slots. Claimed jobs count against every cap until they end.

    The statement assigns the slots itself (the lowest free ones, in claim order) under a
    transaction-scoped lock that every claim takes first (PostgreSQL: an advisory lock; SQLite:
    its single writer), so concurrent claims, from any process or machine, never pick the same
    slot and never retry; the unique constraints over executing rows (lane, slot, organization
    slot) stay as the last guard. Rows another transaction holds are passed over (``SKIP
    LOCKED``). Each claimed job gets its event, its transition log line and its ``on_started``
    hook (after commit); the lanes' interactive streaks are updated in one statement.
    """
    if limit < 1:
        return []
    params = claim_params(worker=worker, limit=limit, now=now or timezone.now())
    try:
        return _claim(limit, params)
    except IntegrityError:
        # Only a claimer outside the claim lock (a worker of an older release during a rolling
        # deploy) can take a slot this statement chose: nothing was claimed; the next look, or
        # the maintenance pump, claims again.
        logger.warning("claim passed: a concurrent claim outside the claim lock took a slot")
        return []


def _claim(limit: int, params: dict) -> list[Job]:
    """The claim's transaction holds the claim lock until its commit, so it does only what must be
    atomic with the claim. On PostgreSQL that is the claim statement alone (with the events and the
    lanes' streaks): its rows are read after the commit, and each job's bookkeeping (its
    transition log line, its ``on_started`` hook) is registered after it everywhere."""
    claimed = _claim_in_one_round_trip(limit, params)
    if claimed is None:
        claimed = _claim_in_transaction(limit, params)
    claimed.sort(key=lambda job: job.slot)  # slots were handed out in claim order
    # Committed (or, inside a caller's transaction, written with it: both go to its commit).
    for job in claimed:
        # No way leads back to queued (seed 000's matrix): a job waited queued before its
        # first attempt, awaiting_tool before any later one.
        before = JobState.QUEUED if job.attempts == 1 else JobState.AWAITING_TOOL
        transition_log(entity="job", id=job.pk, project=job.project_id, run=job.run_id, type=job.type,
                       attempt=job.attempts, **{"from": before, "to": JobState.EXECUTING}, reason="",
                       **_trace_fields(job.traceparent))
        definition = definition_get(job.type)
        if definition is not None:
            _after_commit_hook(definition, "on_started", job.pk)
    return claimed


def _claim_in_transaction(limit: int, params: dict) -> list[Job]:
    """The claim in a transaction of Django's (its own, or the caller's it joins)."""
    joined = connection.in_atomic_block  # a caller's transaction goes on after the claim
    cursor = hot_cursor()
    try:
        with transaction.atomic():
            if connection.vendor == "postgresql":  # the lock, then the pick (``fresh_sql``)
                if not _lock_and_pick(cursor, limit, params):
                    _planner_restore(joined)
                    return []  # no eligible job (an aged one would have been picked too): no claim statement
            cursor.execute(claim_sql(limit), params)
            if connection.vendor == "postgresql":
                _planner_restore(joined)
            if not events_inline():
                claimed = _jobs_from_rows(cursor.fetchall())
                if claimed:
                    _claimed_write(claimed)
        if events_inline():  # committed: the rows the statement returned are decoded outside the lock
            claimed = _jobs_from_rows(cursor.fetchall())
    finally:
        cursor.close()
    return claimed


def _planner_restore(joined: bool) -> None:
    """In a caller's transaction, which goes on after the claim: sequential scans and the plan
    cache's mode as its session had them (``LOCK_SQL`` changed them for the pick and the claim
    statement; a transaction of the claim's own ends with its commit, and the settings with it)."""
    if joined:
        with hot_cursor() as cursor:
            cursor.execute(RESTORE_SQL, list(_SESSION_PLANNER[connection.connection][1:]))


def _claim_in_one_round_trip(limit: int, params: dict) -> list[Job] | None:
    """PostgreSQL, outside any transaction, once the connection's planner settings are known: the
    claim's whole transaction (``BEGIN``, the lock, the pick, the claim statement, ``COMMIT``) sent
    in one round trip (psycopg's pipeline mode), so the claim lock is held for the server's work
    alone: between two round trips its holder may lose the CPU to another process while every
    other claim waits. None where this does not apply (the claim then runs in a transaction of
    Django's, ``_claim_in_transaction``). A statement that fails rolls the whole transaction back."""
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return None
    connection.ensure_connection()
    raw = connection.connection
    known = _SESSION_PLANNER.get(raw)
    if known is None:
        return None
    sort = known[0]
    steps, claim = hot_cursor(), hot_cursor()
    try:
        try:  # (an error surfaces at the pipeline's end: Django's error classes all the same)
            with connection.wrap_database_errors, prepared_at_once(raw), raw.pipeline():
                steps.execute("BEGIN")
                steps.execute(LOCK_SQL, [CLAIM_LOCK_KEY])
                steps.execute(fresh_sql(limit), {**params, "sort": sort})
                claim.execute(claim_sql(limit), params)
                steps.execute("COMMIT")
        except Exception:
            with contextlib.suppress(Exception):  # a broken connection: Django replaces it on its next use
                raw.rollback()
            raise
        return _jobs_from_rows(claim.fetchall())
    finally:
        steps.close()
        claim.close()


# The planner settings ``LOCK_SQL`` changes and the pick or ``RESTORE_SQL`` give back, as each
# connection's session has them (read by the connection's first claim; nothing of ours sets them
# for a session).
_SESSION_PLANNER: "weakref.WeakKeyDictionary[object, tuple[str, str, str]]" = weakref.WeakKeyDictionary()


def _lock_and_pick(cursor, limit: int, params: dict) -> list[int]:
    """The claim lock, then the pick of the fresh candidates under it: the ids picked (locked).

    Both are sent in one round trip (psycopg's pipeline mode) once the connection's planner
    settings are known: the lock is held from its statement to the commit, and every round trip
    in between is a moment its holder may lose the CPU to another process while the others wait."""
    raw = connection.connection
    known = _SESSION_PLANNER.get(raw)
    if known is None:
        cursor.execute(LOCK_SQL, [CLAIM_LOCK_KEY])
        _, sort, seqscan, plans = cursor.fetchone()[:4]
        _SESSION_PLANNER[raw] = (sort, seqscan, plans)
        cursor.execute(fresh_sql(limit), {**params, "sort": sort})
        return cursor.fetchone()[1] or []
    sort = known[0]
    with raw.pipeline():
        cursor.execute(LOCK_SQL, [CLAIM_LOCK_KEY])
        cursor.execute(fresh_sql(limit), {**params, "sort": sort})
    return cursor.fetchone()[1] or []


def _claimed_write(claimed: list[Job]) -> None:
    """Where the claim statement cannot write them itself (SQLite): the lanes' streaks and the events
    (in claim order)."""
    claimed.sort(key=lambda job: job.slot)
    _lanes_streak(claimed)
    events_record([{"type": JOB_STATE_EVENTS[JobState.EXECUTING], "organization_id": job.organization_id,
                    "project_id": job.project_id, "run_id": job.run_id, "payload": job_as_dict(job)}
                   for job in claimed])


def claim_warm() -> None:
    """Plan the claim's statements once on this process's connection (PostgreSQL ``EXPLAIN``:
    nothing is executed or locked), so that a new worker's first claim, which holds the claim
    lock, does not also load the catalog entries of every table and index it touches (about
    10 ms on a new connection, paid by every claim queued behind it)."""
    if connection.vendor != "postgresql":
        return
    params = claim_params(worker="", limit=1, now=timezone.now())
    with hot_cursor() as cursor:
        # a process's first claims take one job, its claims after quick jobs a full batch
        for limit in sorted({1, max(1, settings.ORCHESTRATOR_QUEUE_CLAIM_BATCH)}):
            cursor.execute("EXPLAIN " + fresh_sql(limit), {**params, "batch": limit, "sort": "on"})
            cursor.execute("EXPLAIN " + claim_sql(limit), {**params, "batch": limit})


def claim_params(*, worker: str, limit: int, now) -> dict:
    """The parameters of ``claim_sql``: the settings as they are now, the time, the worker."""
    adapt = connection.ops.adapt_datetimefield_value
    global_cap = settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY
    organization_cap = organization_max_executing()
    return {
        "now": adapt(now), "touched": adapt(timezone.now()),
        "aging": adapt(now - timedelta(milliseconds=settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS)),
        "lease": adapt(now + timedelta(seconds=settings.ORCHESTRATOR_QUEUE_LEASE_S)),
        "burst": settings.ORCHESTRATOR_QUEUE_MAX_INTERACTIVE_BURST, "worker": worker,
        "global_cap": global_cap, "organization_cap": organization_cap,
        "span": max(global_cap, organization_cap, 1), "batch": limit,
    }


def _lanes_streak(claimed: list[Job]) -> None:
    """The aging guard's count: an interactive job started on a lane adds one to its streak, a
    background job resets it (a batch holds at most one job per lane)."""
    lanes = {job.lane: job.priority_class == PriorityClass.INTERACTIVE for job in claimed if job.lane}
    if not lanes:
        return
    interactive = [lane for lane, flag in lanes.items() if flag]
    JobLane.objects.filter(key__in=list(lanes)).update(
        interactive_streak=Case(When(key__in=interactive, then=F("interactive_streak") + 1), default=Value(0)),
        updated_at=timezone.now())
