"""An attempt's outcomes: progress, completion, failure with the retry decision, and failing a job now."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from core.fsm import moves_may_wait
from core.services import audit_record, events_record, row_lock, transition_log
from core.sql import hot_cursor, per_vendor, prepared_at_once
from jobs.events import JOB_STATE_EVENTS
from jobs.models import Job, JobReason, JobState
from jobs.registry import definition_get
from jobs.services.claim_sql import job_events_insert
from jobs.services.common import (_after_commit_hook, _current, _job_columns, _jobs_from_rows, _move,
                                  _trace_fields, _wake, job_as_dict)


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
            _after_commit_hook(definition, "on_completed", job.pk)
        return True


@per_vendor
def _complete_sql() -> str:
    """``jobs_complete``'s statement, one text for any number of jobs (built once per process)."""
    return _complete_update(f"RETURNING {_job_columns()}")


def _complete_update(returning: str) -> str:
    """The completion's ``UPDATE`` of the jobs given (on PostgreSQL ``v.n`` is each one's place in
    the arguments), with ``returning``."""
    job = connection.ops.quote_name(Job._meta.db_table)
    if connection.vendor == "postgresql":
        source = ("unnest(%(ids)s::bigint[], %(attempts)s::integer[], %(results)s::text[])"
                  " WITH ORDINALITY AS v(id, attempt, result, n)")
        id_, attempt, result = "v.id", "v.attempt", "v.result::jsonb"
    else:  # one JSON array of [id, attempt, result as JSON text or null]
        source = "json_each(%(rows)s) AS v"
        id_, attempt, result = "json_extract(v.value, '$[0]')", "json_extract(v.value, '$[1]')", \
            "json_extract(v.value, '$[2]')"
    return (f"UPDATE {job} SET state = '{JobState.COMPLETED}', reason = '{JobReason.COMPLETED}', result = {result},"
            " error = '', completed_at = %(now)s, active_dedupe_key = NULL, slot = NULL, organization_slot = NULL,"
            f" lease_expires_at = NULL, updated_at = %(now)s FROM {source}"
            f" WHERE {job}.id = {id_} AND {job}.state = '{JobState.EXECUTING}' AND {job}.attempts = {attempt}"
            f" {returning}")


@per_vendor
def _complete_alone_sql() -> str:
    """PostgreSQL's ``jobs_complete`` as a transaction of one statement: the jobs' update, their
    events (built by the statement, in the order of the results given) and, returned, what each
    one's transition log line names."""
    update = _complete_update(f"RETURNING {_job_columns()}, v.n")
    return (f"WITH done AS ({update}), events AS ({job_events_insert(JobState.COMPLETED, source='done', order='c.n')})"
            " SELECT id, project_id, run_id, type, attempts, traceparent FROM done ORDER BY n")


def jobs_complete(*, results: list[tuple[int, int, Any]]) -> set[int]:
    """Several attempts' executing → completed with their results, ``(job_id, attempt, result)``
    each, in one statement; returns the ids completed. An attempt that is no longer current
    (cancelled, recovered, finished meanwhile) is discarded, as ``job_complete`` discards it.
    Events are written in one statement, one transition log line and ``on_completed`` hook
    (after commit) per job. On PostgreSQL outside a transaction (a worker's batch) the update and
    the events are one statement, a transaction of its own: one round trip (``BEGIN``, the update,
    the events and ``COMMIT`` were four), and only the columns the log lines name come back."""
    if not results:
        return set()
    now = connection.ops.adapt_datetimefield_value(timezone.now())
    texts = [None if result is None else json.dumps(result) for _, _, result in results]
    if connection.vendor == "postgresql":
        params = {"ids": [job_id for job_id, _, _ in results], "attempts": [attempt for _, attempt, _ in results],
                  "results": texts, "now": now}
        if not connection.in_atomic_block:
            return _jobs_complete_alone(params)
    else:
        params = {"rows": json.dumps([[job_id, attempt, text] for (job_id, attempt, _), text in zip(results, texts)]),
                  "now": now}
    order = {job_id: index for index, (job_id, _, _) in enumerate(results)}
    with transaction.atomic():
        with hot_cursor() as cursor:
            cursor.execute(_complete_sql(), params)
            completed = sorted(_jobs_from_rows(cursor.fetchall()), key=lambda job: order[job.pk])
        events_record([{"type": JOB_STATE_EVENTS[JobState.COMPLETED], "organization_id": job.organization_id,
                        "project_id": job.project_id, "run_id": job.run_id, "payload": job_as_dict(job)}
                       for job in completed])
        for job in completed:
            transition_log(entity="job", id=job.pk, project=job.project_id, run=job.run_id, type=job.type,
                           attempt=job.attempts, **{"from": JobState.EXECUTING, "to": JobState.COMPLETED},
                           reason=JobReason.COMPLETED, **_trace_fields(job.traceparent))
            definition = definition_get(job.type)
            if definition is not None:
                _after_commit_hook(definition, "on_completed", job.pk)
    return {job.pk for job in completed}


def _jobs_complete_alone(params: dict) -> set[int]:
    with hot_cursor() as cursor, prepared_at_once(connection.connection):
        cursor.execute(_complete_alone_sql(), {**params, "touched": params["now"]})
        rows = cursor.fetchall()
    for job_id, project_id, run_id, job_type, attempts, traceparent in rows:
        transition_log(entity="job", id=job_id, project=project_id, run=run_id, type=job_type, attempt=attempts,
                       **{"from": JobState.EXECUTING, "to": JobState.COMPLETED}, reason=JobReason.COMPLETED,
                       **_trace_fields(traceparent))
        definition = definition_get(job_type)
        if definition is not None:
            _after_commit_hook(definition, "on_completed", job_id)  # committed: called now
    return {row[0] for row in rows}


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
                _after_commit_hook(definition, "on_failed", job.pk)
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
            _after_commit_hook(definition, "on_failed", job.pk)
        return job


def job_retarget(*, job_id: int, attempt: int, job_type: str, project_id: int, payload: dict,
                 savepoint: bool = True) -> bool:
    """Point the executing attempt of a job at new work, in the caller's transaction: its payload
    and dedupe key become those of ``payload`` (a recovered attempt then resumes that work).

    False, and nothing written, when the attempt is no longer current, its cancellation was
    requested (it is not given more work), or an active job of the same type already holds the new
    dedupe key (that job does the work). Only the unique dedupe
    key can conflict: that one statement runs under a savepoint. ``savepoint=False``: the caller
    holds a lock every writer of such keys holds, so the statement itself checks that no active
    job holds the key (a conflict past that check fails the caller's transaction, as any failed
    statement would).
    """
    definition = definition_get(job_type)
    if definition is None:
        return False
    payload = definition.validated(payload)
    key = definition.dedupe.key(payload, project_id) if definition.dedupe.mode != "none" else None
    values = {"payload": payload, "dedupe_key": key or "", "active_dedupe_key": f"{definition.type}:{key}" if key else None,
              "updated_at": timezone.now()}
    if not savepoint:  # one prepared statement: a chained step retargets its job at every step
        fields = [Job._meta.get_field(name) for name in values]
        params = [field.get_db_prep_save(values[field.name], connection) for field in fields]
        with moves_may_wait(), hot_cursor() as cursor:  # the job's row only: a run's kept moves wait
            cursor.execute(_retarget_sql(), [*params, job_id, job_type, attempt, JobState.EXECUTING,
                                             values["active_dedupe_key"]])
            return cursor.rowcount == 1
    current = Job.objects.filter(pk=job_id, type=job_type, attempts=attempt, state=JobState.EXECUTING,
                                 cancel_requested_at__isnull=True)
    try:
        with transaction.atomic():
            updated = current.update(**values)
    except IntegrityError:
        return False
    return updated == 1


@per_vendor
def _retarget_sql() -> str:
    """``job_retarget``'s statement without a savepoint: the attempt's row, unless an active job
    holds the new dedupe key (none is held by a NULL key) or its cancellation was requested."""
    qn = connection.ops.quote_name
    table = qn(Job._meta.db_table)
    sets = ", ".join(f"{qn(name)} = %s" for name in ("payload", "dedupe_key", "active_dedupe_key", "updated_at"))
    return (f"UPDATE {table} SET {sets} WHERE id = %s AND type = %s AND attempts = %s AND state = %s"
            " AND cancel_requested_at IS NULL"
            f" AND NOT EXISTS (SELECT 1 FROM {table} h WHERE h.active_dedupe_key = %s)")


def jobs_renew_leases(*, attempts: dict[int, int], worker: str) -> set[int]:
    """Push forward the leases of claimed attempts ``{job_id: attempt}`` that ``worker`` still
    holds (executing, that attempt); returns their ids. A batch's jobs wait their turn with it."""
    held = Job.objects.filter(pk__in=list(attempts), state=JobState.EXECUTING, worker=worker)
    with transaction.atomic():
        rows = [(job_id, attempt) for job_id, attempt in held.select_for_update().values_list("pk", "attempts")
                if attempts.get(job_id) == attempt]
        Job.objects.filter(pk__in=[job_id for job_id, _ in rows]).update(
            lease_expires_at=timezone.now() + timedelta(seconds=settings.ORCHESTRATOR_QUEUE_LEASE_S),
            updated_at=timezone.now())
    return {job_id for job_id, _ in rows}
