"""The run lifecycle services: create, start, mark running, heartbeat, complete, fail, recover, pause,
resume, cancel, void, retry, requeue and delete (seed 001 §1.3).
"""

from __future__ import annotations

from typing import Any, Callable

from django.conf import settings
from django.utils import timezone
from django_fsm import can_proceed

from billing.errors import InsufficientCredits
from billing.selectors import account_available_sql
from core.errors import (
    InvalidTransition,
    ValidationFailed,
)
from core.models import Project
from core.sql import insert_returning
from core.services import actor_label, audit_record, transition_log
from runs.errors import PlanIsContract, RunNotStuck
from runs.events import RUN_DELETED
from runs.models import (
    Agent,
    ApprovalRequest,
    FailureMode,
    NodeStatus,
    Run,
    RunAttempt,
    Step,
    Task,
)
from runs.outbox import run_atomic, run_event_record
from runs.pipeline import bookkeeping
from runs.plan import plan_cost_estimate, plan_is_gated, plan_validate
from runs.selectors import run_current_attempt
from runs.services.common import (
    _apply,
    _close_attempt,
    _dispatch,
    _duration_ms,
    _lock_run,
    _lock_run_moved,
    _node_move,
    _nodes_move,
    _record_run_change,
    _snapshot,
    _spawn_hierarchy,
    _terminate_live_nodes,
)
from runs.services.credits import _reserve, _settle
from runs.services.propagation import _apply_failure_deferred_by_pause
from runs.services.settlement import _complete_locked, _fail_locked, _retry_locked
from runs.substates import StatusReason, SubState, status_reason


@run_atomic()
def run_create(*, project: Project, name: str, plan: Any, priority: int = 100,
               failure_mode: str = FailureMode.FAIL_FAST, max_attempts: int = 3,
               credit_limit: int | None = None, actor=None, reason: str = "", mode: str = "live") -> Run:
    """Create a run in ``created`` after validating the plan and the organization's credits.

    ``credit_limit`` (credits reserved per attempt) defaults to the plan's worst-case cost; a
    live run's may not be less than one try of each step costs.
    ``mode`` ``dryrun`` runs the checks and gates but executes no tool step (nothing is charged).
    Nothing is written when the input is invalid or the credits are not available.
    """
    errors: dict[str, list[str]] = {}
    if not isinstance(name, str) or not name.strip():
        errors["name"] = ["required, a non-empty string"]
    elif len(name) > 200:
        errors["name"] = ["at most 200 characters"]
    if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
        errors["priority"] = ["a whole number from -1000 to 1000"]
    if failure_mode not in FailureMode.values:
        errors["failure_mode"] = [f"one of {', '.join(FailureMode.values)}"]
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or not 1 <= max_attempts <= 10:
        errors["max_attempts"] = ["a whole number from 1 to 10"]
    if credit_limit is not None and (isinstance(credit_limit, bool) or not isinstance(credit_limit, int)
                                     or credit_limit <= 0):
        errors["credit_limit"] = ["a whole number greater than zero"]
    if mode not in ("live", "dryrun"):
        errors["mode"] = ["one of live, dryrun"]
    try:
        plan_validate(plan)
    except ValidationFailed as exc:
        errors.update(exc.errors)
    else:
        least = plan_cost_estimate(plan, tries_per_step=1) if mode != "dryrun" else 1
        if "credit_limit" not in errors and credit_limit is not None and credit_limit < least:
            errors["credit_limit"] = [f"at least {least}: one try of each step of the plan costs {least} credits"]
    if errors:
        raise ValidationFailed("invalid run", errors=errors)
    limit = credit_limit if credit_limit is not None else plan_cost_estimate(plan)
    run = Run(
        organization_id=project.organization_id, project=project, name=name.strip(), plan=plan, priority=priority,
        failure_mode=failure_mode, max_attempts=max_attempts, credit_limit=limit,
        max_agents=plan.get("max_agents", settings.ORCHESTRATOR_MAX_AGENTS),
        created_by=actor if getattr(actor, "pk", None) else None, status_changed_at=timezone.now(),
        mode=mode, gated=plan_is_gated(plan),
    )
    # The row and the organization's available credits in one statement; too few: the transaction
    # rolls the row back (nothing is written).
    available = insert_returning(run, account_available_sql(), [project.organization_id]) or 0
    if available < limit:
        raise InsufficientCredits(
            f"organization {project.organization_id} has {available} credits available; "
            f"the run needs {limit}", available=available, required=limit)
    before = {"status": "", "attempt": 1}
    _record_run_change(run, before=before, action="create", actor=actor, reason=reason, created=True)
    return run


@run_atomic()
def run_start(*, run_id: int, actor=None, reason: str = "") -> Run:
    """created → pending: reserve ``credit_limit`` for attempt 1 and hand the run to a worker.

    Already pending: returns the run unchanged. ``InsufficientCredits`` leaves it created.
    """
    run = _lock_run_moved(run_id, "start", source=Run.Status.CREATED)
    if run is not None:  # locked and saved pending with its reservation (inserted and written below)
        before = {**_snapshot(run), "status": Run.Status.CREATED,
                  "credits_reserved": run.credits_reserved - run.credit_limit}
        run.credits_reserved = before["credits_reserved"]  # what _reserve adds as it reserves
        _reserve(run, RunAttempt(run=run, number=run.attempt_number), actor=actor, reason=reason)
        _record_run_change(run, before=before, action="start", actor=actor, reason=reason, moved=True)
        _dispatch(run)
        return run
    run = _lock_run(run_id)
    if run.status == Run.Status.PENDING:
        return run
    if run.deleted_at is not None:
        raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="start", why="deleted")
    before = _snapshot(run)
    _apply(run, "start")
    bookkeeping.pipeline_keys_claim(run)  # a gated run's phase keys; another run's key refuses the start
    attempt = RunAttempt(run=run, number=run.attempt_number)  # inserted with its reservation
    _reserve(run, attempt, actor=actor, reason=reason)
    _record_run_change(run, before=before, action="start", actor=actor, reason=reason)
    _dispatch(run)
    return run


@run_atomic()
def run_mark_running(*, run_id: int, then: Callable[[Run], Any] | None = None) -> Run:
    """pending → running (spawn the attempt's agents) or resuming → running. Running: no-op.
    ``then`` is called with the run (locked) in the same transaction when the run is running
    (the engine schedules its runnable steps there)."""
    run = _lock_run_moved(run_id, "mark_running", source=Run.Status.PENDING)
    if run is not None:  # locked and saved running, with its heartbeat and start
        before = {**_snapshot(run), "status": Run.Status.PENDING}
        if _spawn_hierarchy(run):
            bookkeeping.pipeline_begin(run)
        _record_run_change(run, before=before, action="mark_running", moved=True)
        if then is not None:
            then(run)
        return run
    run = _lock_run(run_id)
    if run.status == Run.Status.RUNNING:
        if then is not None:
            then(run)
        return run
    before = _snapshot(run)
    from_resuming = run.status == Run.Status.RESUMING
    _apply(run, "mark_running")
    now = timezone.now()
    run.last_heartbeat = now
    if not from_resuming:
        run.started_at = run.started_at or now
        if _spawn_hierarchy(run):
            bookkeeping.pipeline_begin(run)
    run.status_reason = ""
    _record_run_change(run, before=before, action="mark_running")
    if from_resuming:
        _apply_failure_deferred_by_pause(run)
    if then is not None and run.status == Run.Status.RUNNING:
        then(run)
    return run


def run_heartbeat(*, run_id: int) -> bool:
    """Record that a worker is alive for this run. Returns False when the run is not active."""
    return bool(Run.objects.filter(pk=run_id, status__in=[Run.Status.RUNNING, Run.Status.RESUMING])
                .update(last_heartbeat=timezone.now()))


@run_atomic()
def run_complete(*, run_id: int, actor=None, reason: str = "") -> Run:
    """running → completed once every agent is done: release the unused reservation.

    Already completed: returns the run unchanged.
    """
    run = _lock_run(run_id)
    if run.status == Run.Status.COMPLETED:
        return run
    return _complete_locked(run, actor=actor, reason=reason)


@run_atomic()
def run_fail(*, run_id: int, code: str, message: str, actor=None, reason: str = "") -> Run:
    """pending|running|resuming|retrying → failed: end live agents, release the unused
    reservation, record ``last_error``. Already failed: returns the run with its existing error.
    """
    if not code or not isinstance(code, str):
        raise ValidationFailed("an error code is required", errors={"code": ["must not be empty"]})
    run = _lock_run(run_id)
    if run.status == Run.Status.FAILED:
        return run
    return _fail_locked(run, code=code, message=message or code, actor=actor, reason=reason,
                        action="force_fail" if actor is not None else "fail")


HEARTBEAT_TIMEOUT_CODE = "heartbeat_timeout"


@run_atomic()
def run_recover(*, run_id: int, older_than_s: int, actor=None, reason: str = "") -> Run:
    """Seed 001 §9.1's recovery: a running run whose worker has been silent for ``older_than_s``
    (and whose work is not simply waiting in the queue) → failed with ``heartbeat_timeout``: live
    agents terminated, the unused reservation refunded. Judged under the run's row lock, so a
    heartbeat that arrived since the operator looked saves the run (``RunNotStuck``). Already
    failed: no-op."""
    from runs.selectors import runs_heartbeat_stale

    run = _lock_run(run_id)
    if run.status == Run.Status.FAILED:
        return run
    if run.status != Run.Status.RUNNING:
        raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="recover",
                                why="only a running run can be stuck")
    if not runs_heartbeat_stale(older_than_s=older_than_s).filter(pk=run.pk).exists():
        raise RunNotStuck(entity="run", entity_id=run.pk, current=run.status, requested="recover",
                          why=f"its worker was heard from in the last {older_than_s} s, or its work waits in the queue")
    seen = run.last_heartbeat or run.started_at
    silent = f"{int((timezone.now() - seen).total_seconds())} s" if seen else "ever"
    return _fail_locked(run, code=HEARTBEAT_TIMEOUT_CODE, message=f"no worker heartbeat for {silent}; recovered by "
                        f"{actor_label(actor)}", actor=actor, reason=reason, action="recover")


@run_atomic()
def run_pause(*, run_id: int, actor=None, reason: str = "", status_reason: str = "") -> Run:
    """running → paused: pause live agents, tasks and steps; no new work starts. Paused: no-op."""
    run = _lock_run(run_id)
    if run.status == Run.Status.PAUSED:
        return run
    before = _snapshot(run)
    _apply(run, "pause")
    for model, filters in ((Agent, {"attempt_number": run.attempt_number}),
                           (Task, {"agent__attempt_number": run.attempt_number}),
                           (Step, {"task__agent__attempt_number": run.attempt_number})):
        _nodes_move(model.objects.filter(run=run, status__in=[NodeStatus.PENDING, NodeStatus.RUNNING], **filters),
                    "pause", run=run)
    run.status_reason = status_reason or "paused"
    _record_run_change(run, before=before, action="pause", actor=actor, reason=reason)
    return run


@run_atomic()
def run_resume(*, run_id: int, actor=None, reason: str = "") -> Run:
    """paused → resuming: paused agents, tasks and steps back to pending; a worker then moves
    the run to running. Already resuming: no-op.
    """
    run = _lock_run(run_id)
    if run.status == Run.Status.RESUMING:
        return run
    if run.gated and run.status == Run.Status.PAUSED:
        bookkeeping.drift_refuse_unacknowledged(run)  # a stopped_drift run waits for an acknowledgment
    before = _snapshot(run)
    _apply(run, "resume")
    for model, filters in ((Agent, {"attempt_number": run.attempt_number}),
                           (Task, {"agent__attempt_number": run.attempt_number}),
                           (Step, {"task__agent__attempt_number": run.attempt_number})):
        _nodes_move(model.objects.filter(run=run, status=NodeStatus.PAUSED, **filters), "unpause", run=run)
    run.status_reason = ""
    _record_run_change(run, before=before, action="resume", actor=actor, reason=reason)
    _dispatch(run)
    return run


def _end_cancelled(run: Run, *, actor, reason: str) -> RunAttempt | None:
    """A run just moved to cancelled (cancel or void): end its live agents, release every credit
    not charged and stamp the end. Returns the attempt, for the caller to close."""
    attempt = run_current_attempt(run)
    _terminate_live_nodes(run, attempt_number=run.attempt_number)
    _settle(run, attempt, actor=actor, reason=reason)
    now = timezone.now()
    run.cancelled_at = now
    run.duration_ms = _duration_ms(run, now)
    return attempt


@run_atomic()
def run_cancel(*, run_id: int, actor=None, reason: str = "", code: str = "cancelled") -> Run:
    """created|pending|running|paused → cancelled: end live agents, release every credit not
    charged. Already cancelled: no-op.
    """
    run = _lock_run(run_id)
    if run.status == Run.Status.CANCELLED:
        return run
    before = _snapshot(run)
    _apply(run, "cancel")
    attempt = _end_cancelled(run, actor=actor, reason=reason)
    if code != "cancelled":
        run.last_error_code = code
        run.last_error = reason or code
    _close_attempt(run, attempt, outcome=Run.Status.CANCELLED, error_code=code)
    released = (bookkeeping.pipeline_keys_release(run, reason=f"cancelled: {reason}" if reason else "cancelled")
                if run.gated else [])
    voided = _approvals_void(run, reason=reason or "cancelled") if run.gated else 0
    if StatusReason.parse(run.status_reason).is_(SubState.AWAITING_APPROVAL):  # nothing waits for that approval any more
        run.status_reason = ""
    extra = {key: value for key, value in (("released_keys", released), ("voided_approvals", voided)) if value}
    _record_run_change(run, before=before, action="cancel", actor=actor, reason=reason, extra=extra or None)
    return run


def _approvals_void(run: Run, *, reason: str) -> int:
    """Void the run's pending approval requests (its run ended): one transition line each."""
    pending = list(ApprovalRequest.objects.filter(run=run, status=ApprovalRequest.Status.PENDING))
    for request in pending:
        request.status = ApprovalRequest.Status.VOIDED
        request.save(update_fields=["status"])
        transition_log(entity="approval", id=request.pk, project=run.project_id, run=run.pk,
                       attempt=request.attempt_number, gate=request.gate,
                       **{"from": ApprovalRequest.Status.PENDING, "to": request.status}, reason=reason)
    return len(pending)


@run_atomic()
def run_void(*, run_id: int, actor=None, reason: str) -> Run:
    """paused|failed → cancelled with the status reason ``voided:<reason>`` (seed 002's void): end
    live agents, release every credit not charged, release the run's phase idempotency keys (a
    new run may claim them) and void its pending approval requests. Already voided: no-op.
    """
    reason = (reason or "").strip()
    if not reason:
        raise ValidationFailed("a reason is required", errors={"reason": ["must not be empty"]})
    run = _lock_run(run_id)
    if run.status == Run.Status.CANCELLED and StatusReason.parse(run.status_reason).is_(SubState.VOIDED):
        return run
    if not can_proceed(run.void):
        raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="void",
                                why="only a stopped run (paused or failed) can be voided")
    before = _snapshot(run)
    run.void()
    attempt = _end_cancelled(run, actor=actor, reason=reason)
    run.status_reason = status_reason(SubState.VOIDED, reason)
    if attempt is not None and not attempt.outcome:
        _close_attempt(run, attempt, outcome=Run.Status.CANCELLED, error_code="voided")
    released = bookkeeping.pipeline_keys_release(run, reason=f"voided: {reason}")
    voided = _approvals_void(run, reason=f"voided: {reason}")
    _record_run_change(run, before=before, action="void", actor=actor, reason=reason,
                       extra={"released_keys": released, "voided_approvals": voided})
    return run


@run_atomic()
def run_retry(*, run_id: int, actor=None, reason: str = "", plan: dict | None = None) -> Run:
    """failed → retrying while ``attempt_number < max_attempts``: a new attempt with a new
    reservation; earlier agents, tasks and steps stay for audit. Already retrying: no-op.

    With ``plan``, the new attempt runs that plan: it is validated like a new run's (format, size
    caps, one try of each step within the run's ``credit_limit``), and the audit record keeps the
    plan before and after. A gated run's plan is its contract: ``PlanIsContract``.
    """
    run = _lock_run(run_id)
    if run.status == Run.Status.RETRYING:
        return run
    if plan is not None:
        _retry_plan_check(run, plan)
    return _retry_locked(run, actor=actor, reason=reason, plan=plan)


def _retry_plan_check(run: Run, plan: Any) -> None:
    if run.gated:
        raise PlanIsContract(f"run {run.pk} is a gated pipeline: its plan is its contract and cannot be edited; "
                             "void it and create a new run instead")
    plan_validate(plan)
    errors = []
    if plan_is_gated(plan):
        errors.append("a retry cannot turn a run into a gated pipeline: create a new run")
    least = plan_cost_estimate(plan, tries_per_step=1) if run.mode != "dryrun" else 1
    if run.credit_limit < least:
        errors.append(f"one try of each step costs {least} credits, more than the run's credit_limit "
                      f"({run.credit_limit})")
    if errors:
        raise ValidationFailed("invalid plan", errors={"plan": errors})


@run_atomic()
def run_requeue(*, run_id: int) -> Run:
    """retrying → pending: the new attempt waits for a worker. Already pending: no-op."""
    run = _lock_run(run_id)
    if run.status == Run.Status.PENDING:
        return run
    before = _snapshot(run)
    _apply(run, "requeue")
    _record_run_change(run, before=before, action="requeue")
    return run


@run_atomic()
def run_delete(*, run_id: int, actor=None, reason: str = "") -> Run:
    """Soft-delete a run that was never started (``created``). Already deleted: no-op."""
    run = _lock_run(run_id)
    if run.deleted_at is not None:
        return run
    if run.status != Run.Status.CREATED:
        raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="delete",
                                why="only created runs can be deleted")
    before = _snapshot(run)
    run.deleted_at = timezone.now()
    run.save(update_fields=["deleted_at", "updated_at"])
    run_event_record(type=RUN_DELETED, organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                     payload={"run": run.pk, "reason": reason})
    audit_record(actor=actor, action="run_delete", target_type="run", target_id=run.pk,
                 organization_id=run.organization_id, run_id=run.pk, reason=reason, before=before,
                 after={**_snapshot(run), "deleted": True})
    return run

