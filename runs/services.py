"""The only writers of runs and their hierarchy.

One service per transition. Each opens a transaction, locks the run row
(``select_for_update``), re-checks the state, calls the django-fsm-2 transition, writes the
ledger entries, the event row and (for operator actions) the audit row, and saves. Every
service that touches an agent, a task or a step locks the run first, so the run row
serializes all writers of one run (lock order: run → job → credit account).

Repeating a transition into the state the run is already in is a no-op (seed 001 §1.3);
any other forbidden transition raises ``InvalidTransition`` naming the run, its state and the
requested action, and changes nothing.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django_fsm import can_proceed

from billing.models import LedgerEntry
from billing.services import ledger_charge, ledger_refund, ledger_reserve
from billing.selectors import account_balance
from core.errors import CreditLimitExceeded, InsufficientCredits, InvalidTransition, NotFound, ValidationFailed
from core.metrics import metric_sample, metrics_add
from core.models import Project
from core.services import actor_label, audit_record, event_record, transition_log
from runs import pipeline
from runs.models import (
    SETTLED_RUN_STATES,
    DONE_NODE_STATES,
    LIVE_NODE_STATES,
    MAX_RETRIES_PER_LEVEL,
    Agent,
    ApprovalRequest,
    Artifact,
    FailureMode,
    NodeStatus,
    ParallelismMode,
    Run,
    RunAttempt,
    Step,
    StepAttempt,
    Task,
)
from runs.plan import plan_cost_estimate, plan_is_gated, plan_validate
from runs.tools import tool_get

STEP_BACKOFF_BASE_MS = 100
STEP_BACKOFF_CAP_MS = 30_000

# Called after commit with a run id whenever a run needs a worker (start, resume, retry).
# The execution engine registers itself here; nothing is called when none is registered.
RUN_DISPATCHERS: list[Callable[[int], None]] = []
# Called after commit with the id of every failed step attempt (diagnosis registers here).
STEP_FAILURE_HOOKS: list[Callable[[int], None]] = []


def _dispatch_after_commit(run_id: int) -> None:
    for dispatcher in RUN_DISPATCHERS:
        transaction.on_commit(lambda dispatcher=dispatcher: dispatcher(run_id))


# --- helpers ------------------------------------------------------------------------------

def _lock_run(run_id: int) -> Run:
    try:
        return Run.objects.select_for_update().get(pk=run_id)
    except (Run.DoesNotExist, ValueError, TypeError) as exc:
        raise NotFound(f"run {run_id} does not exist") from exc


def _snapshot(run: Run) -> dict[str, Any]:
    return {
        "status": run.status,
        "status_reason": run.status_reason,
        "attempt": run.attempt_number,
        "credits_reserved": run.credits_reserved,
        "credits_charged": run.credits_charged,
        "credits_refunded": run.credits_refunded,
        "last_error_code": run.last_error_code,
    }


def _apply(run: Run, action: str, *, why: str = "") -> None:
    """Call the FSM transition ``action`` or raise ``InvalidTransition`` naming the states."""
    method = getattr(run, action)
    if not can_proceed(method):
        if not why and action == "retry" and run.status == Run.Status.FAILED:
            why = f"attempts exhausted ({run.attempt_number} of {run.max_attempts})"
        raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested=action, why=why)
    method()


def _record_run_change(run: Run, *, before: dict, action: str, actor=None, reason: str = "",
                       extra: dict | None = None) -> None:
    now = timezone.now()
    if before["status"] != run.status:
        run.status_changed_at = now
        if run.status in SETTLED_RUN_STATES:  # completed, failed or cancelled: its artifacts' time starts
            Artifact.objects.filter(run=run, expires_at__isnull=True).update(
                expires_at=now + timedelta(days=settings.ORCHESTRATOR_ARTIFACT_TTL_DAYS))
    run.save()
    pipeline.pipeline_clock(run, before_status=before["status"])
    payload = {
        "run": run.pk,
        "name": run.name,
        "from": before["status"],
        "to": run.status,
        "status_reason": run.status_reason,
        "attempt": run.attempt_number,
        "credits_reserved": run.credits_reserved,
        "credits_charged": run.credits_charged,
        "credits_refunded": run.credits_refunded,
        "reason": reason,
        "actor": getattr(actor, "username", None) or "system",
    }
    if run.last_error_code:
        payload["error"] = {"code": run.last_error_code, "message": run.last_error}
    payload.update(extra or {})
    event_record(type=f"run_{run.status}", organization_id=run.organization_id, project_id=run.project_id,
                 run_id=run.pk, payload=payload)
    if before["status"] != run.status and run.status in SETTLED_RUN_STATES:
        metrics_add([metric_sample("runs_finished", state=run.status,
                                   reason=run.last_error_code if run.status == Run.Status.FAILED else "")])
    if actor is not None:
        audit_record(actor=actor, action=f"run_{action}", target_type="run", target_id=run.pk,
                     organization_id=run.organization_id, run_id=run.pk, reason=reason, before=before,
                     after=_snapshot(run))
    transition_log(entity="run", id=run.pk, project=run.project_id, attempt=run.attempt_number,
                   **{"from": before["status"], "to": run.status}, action=action, reason=reason or run.last_error_code)


def _current_attempt(run: Run) -> RunAttempt | None:
    return RunAttempt.objects.filter(run=run, number=run.attempt_number).first()


def _reserve(run: Run, attempt: RunAttempt, *, actor=None, reason: str = "") -> None:
    result = ledger_reserve(organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                            attempt_number=attempt.number, amount=run.credit_limit,
                            idempotency_key=f"attempt:{attempt.number}:reserve", actor=actor,
                            reason=reason or f"reserve for attempt {attempt.number}")
    if result.created:
        attempt.credits_reserved += run.credit_limit
        run.credits_reserved += run.credit_limit
        attempt.save(update_fields=["credits_reserved"])


def _charge(run: Run, attempt: RunAttempt, *, amount: int, key: str, reason: str) -> bool:
    """Charge an attempt's reservation; ``CreditLimitExceeded`` when it would go past it."""
    if LedgerEntry.objects.filter(run_id=run.pk, kind=LedgerEntry.Kind.CHARGE, idempotency_key=key).exists():
        return False
    remaining = attempt.credits_reserved - attempt.credits_charged - attempt.credits_refunded
    if amount > remaining:
        raise CreditLimitExceeded(
            f"run {run.pk} attempt {attempt.number}: charging {amount} would exceed the reservation "
            f"({remaining} of {attempt.credits_reserved} left)", run=run.pk, remaining=remaining)
    result = ledger_charge(organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                           attempt_number=attempt.number, amount=amount, idempotency_key=key, reason=reason)
    if result.created:
        attempt.credits_charged += amount
        run.credits_charged += amount
        attempt.save(update_fields=["credits_charged"])
    return result.created


def _settle(run: Run, attempt: RunAttempt | None, *, actor=None, reason: str = "") -> None:
    """Release what the attempt reserved and did not charge: ``charged + refunded = reserved``."""
    if attempt is None:
        return
    remaining = attempt.credits_reserved - attempt.credits_charged - attempt.credits_refunded
    if remaining <= 0:
        return
    result = ledger_refund(organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                           attempt_number=attempt.number, amount=remaining, source=LedgerEntry.Source.RESERVATION,
                           idempotency_key=f"attempt:{attempt.number}:settle", actor=actor,
                           reason=reason or f"release unused reservation of attempt {attempt.number}")
    if result.created:
        attempt.credits_refunded += remaining
        run.credits_refunded += remaining
        attempt.save(update_fields=["credits_refunded"])


def _close_attempt(run: Run, attempt: RunAttempt | None, *, outcome: str, error_code: str = "") -> None:
    if attempt is None:
        return
    attempt.outcome = outcome
    attempt.error_code = error_code
    attempt.ended_at = timezone.now()
    attempt.save(update_fields=["outcome", "error_code", "ended_at"])


def _duration_ms(run: Run, end) -> int:
    start = run.started_at or run.created_at
    return max(0, int((end - start).total_seconds() * 1000))


def _node_event(node, *, before: str, run: Run, extra: dict | None = None) -> None:
    entity = type(node).__name__.lower()
    payload = {entity: node.pk, "name": node.name, "from": before, "to": node.status, "attempt": run.attempt_number}
    if isinstance(node, Step):
        payload["task"] = node.task_id
    elif isinstance(node, Task):
        payload["agent"] = node.agent_id
    if node.last_error_code:
        payload["error"] = {"code": node.last_error_code, "message": node.last_error}
    payload.update(extra or {})
    event_record(type=f"{entity}_{node.status}", organization_id=run.organization_id, project_id=run.project_id,
                 run_id=run.pk, payload=payload)


def _node_move(node, action: str, *, run: Run, error: tuple[str, str] | None = None, emit: bool = True) -> None:
    before = node.status
    getattr(node, action)()
    now = timezone.now()
    if action == "begin":
        node.started_at = node.started_at or now
    if node.status in DONE_NODE_STATES:
        node.finished_at = now
    if error is not None:
        node.last_error_code, node.last_error = error
    node.save()
    if isinstance(node, Task) and run.gated:
        pipeline.phase_moved(run, node, action=action)
    entity = type(node).__name__.lower()
    transition_log(entity=entity, id=node.pk, project=run.project_id, run=run.pk, attempt=run.attempt_number,
                   action=action, **{"from": before, "to": node.status}, reason=node.last_error_code if
                   error is not None else "", name=node.name)
    if emit:
        _node_event(node, before=before, run=run)


def _discard_open_attempts(run: Run, steps_qs) -> None:
    StepAttempt.objects.filter(run=run, step__in=steps_qs, outcome=StepAttempt.Outcome.RUNNING).update(
        outcome=StepAttempt.Outcome.DISCARDED, finished_at=timezone.now())


def _terminate_live_nodes(run: Run, *, attempt_number: int) -> None:
    """End every live agent, task and step of an attempt (→ cancelled) and discard open attempts."""
    for model in (Step, Task, Agent):
        filters = {"run": run, "status__in": LIVE_NODE_STATES}
        if model is Agent:
            filters["attempt_number"] = attempt_number
        elif model is Task:
            filters["agent__attempt_number"] = attempt_number
        else:
            filters["task__agent__attempt_number"] = attempt_number
        for node in model.objects.filter(**filters):
            _node_move(node, "cancel", run=run, emit=False)
    _discard_open_attempts(run, Step.objects.filter(run=run, task__agent__attempt_number=attempt_number))


def _spawn_hierarchy(run: Run) -> int:
    """Create the agents, tasks and steps of the current attempt from the plan (once)."""
    if Agent.objects.filter(run=run, attempt_number=run.attempt_number).exists():
        return 0
    return _spawn_agents(run, run.plan["agents"])


def _spawn_agents(run: Run, agent_specs: list[dict], *, first_sequence: int = 0) -> int:
    count = 0
    for a_seq, agent_spec in enumerate(agent_specs, start=first_sequence):
        agent = Agent.objects.create(
            run=run, attempt_number=run.attempt_number, name=agent_spec["name"], sequence=a_seq,
            failure_mode=agent_spec.get("failure_mode", FailureMode.FAIL_FAST),
            parallelism_mode=agent_spec.get("parallelism_mode", ParallelismMode.SEQUENTIAL),
        )
        count += 1
        for t_seq, task_spec in enumerate(agent_spec["tasks"]):
            task = Task.objects.create(
                run=run, agent=agent, name=task_spec["name"], sequence=t_seq,
                failure_mode=task_spec.get("failure_mode", FailureMode.FAIL_FAST),
                parallelism_mode=task_spec.get("parallelism_mode", ParallelismMode.SEQUENTIAL),
                depends_on=list(task_spec.get("depends_on") or []),
            )
            Step.objects.bulk_create([
                Step(run=run, task=task, name=step_spec["name"], sequence=s_seq,
                     kind=step_spec.get("kind", Step.Kind.TOOL), tool=step_spec.get("tool", ""),
                     args={**step_spec.get("args", {}),
                           **({"check": step_spec["check"]} if "check" in step_spec else {}),
                           **({"gate": step_spec["gate"]} if "gate" in step_spec else {})},
                     max_tries=MAX_RETRIES_PER_LEVEL if step_spec.get("kind", "tool") == "tool" else 1)
                for s_seq, step_spec in enumerate(task_spec["steps"])
            ])
    return count


# --- run lifecycle ------------------------------------------------------------------------

@transaction.atomic
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
    balance = account_balance(organization_id=project.organization_id)
    if balance["available"] < limit:
        raise InsufficientCredits(
            f"organization {project.organization_id} has {balance['available']} credits available; "
            f"the run needs {limit}", available=balance["available"], required=limit)
    run = Run.objects.create(
        organization_id=project.organization_id, project=project, name=name.strip(), plan=plan, priority=priority,
        failure_mode=failure_mode, max_attempts=max_attempts, credit_limit=limit,
        max_agents=plan.get("max_agents", settings.ORCHESTRATOR_MAX_AGENTS),
        created_by=actor if getattr(actor, "pk", None) else None, status_changed_at=timezone.now(),
        mode=mode, gated=plan_is_gated(plan),
    )
    before = {"status": "", "attempt": 1}
    _record_run_change(run, before=before, action="create", actor=actor, reason=reason)
    return run


@transaction.atomic
def run_start(*, run_id: int, actor=None, reason: str = "") -> Run:
    """created → pending: reserve ``credit_limit`` for attempt 1 and hand the run to a worker.

    Already pending: returns the run unchanged. ``InsufficientCredits`` leaves it created.
    """
    run = _lock_run(run_id)
    if run.status == Run.Status.PENDING:
        return run
    if run.deleted_at is not None:
        raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="start", why="deleted")
    before = _snapshot(run)
    _apply(run, "start")
    pipeline.pipeline_keys_claim(run)  # a gated run's phase keys; another run's key refuses the start
    attempt, _ = RunAttempt.objects.get_or_create(run=run, number=run.attempt_number)
    _reserve(run, attempt, actor=actor, reason=reason)
    _record_run_change(run, before=before, action="start", actor=actor, reason=reason)
    _dispatch_after_commit(run.pk)
    return run


@transaction.atomic
def run_mark_running(*, run_id: int) -> Run:
    """pending → running (spawn the attempt's agents) or resuming → running. Running: no-op."""
    run = _lock_run(run_id)
    if run.status == Run.Status.RUNNING:
        return run
    before = _snapshot(run)
    from_resuming = run.status == Run.Status.RESUMING
    _apply(run, "mark_running")
    now = timezone.now()
    run.last_heartbeat = now
    if not from_resuming:
        run.started_at = run.started_at or now
        if _spawn_hierarchy(run):
            pipeline.pipeline_begin(run)
    run.status_reason = ""
    _record_run_change(run, before=before, action="mark_running")
    if from_resuming:
        _apply_failure_deferred_by_pause(run)
    return run


def _defer_failure_while_paused(run: Run, *, code: str) -> None:
    """A paused run cannot fail: note the agent failure on the open attempt (its ``error_code``,
    overwritten when the attempt closes); ``run_mark_running`` applies it when the run resumes."""
    attempt = _current_attempt(run)
    if attempt is not None and not attempt.outcome:
        attempt.error_code = code
        attempt.save(update_fields=["error_code"])


def _apply_failure_deferred_by_pause(run: Run) -> None:
    """On resume: the agent failure noted during the pause takes effect (re-plan, else the run's
    failure mode); without one, a run whose agents all finished meanwhile settles."""
    attempt = _current_attempt(run)
    failed = None
    if attempt is not None and attempt.error_code and not attempt.outcome:
        attempt.error_code = ""
        attempt.save(update_fields=["error_code"])
        failed = (Agent.objects.filter(run=run, attempt_number=run.attempt_number, status=NodeStatus.FAILED)
                  .order_by("-finished_at", "-pk").first())
    if failed is None:
        _settle_run_if_done(run)
        return
    if _replan(run):
        return
    transient = StepAttempt.objects.filter(step__task__agent=failed, outcome=StepAttempt.Outcome.FAILED).order_by(
        "-finished_at", "-pk").values_list("retryable", flat=True).first() is True
    _run_after_agent_failed(run, code=failed.last_error_code, message=f"agent {failed.name}: {failed.last_error}",
                            transient=transient)


def run_heartbeat(*, run_id: int) -> bool:
    """Record that a worker is alive for this run. Returns False when the run is not active."""
    return bool(Run.objects.filter(pk=run_id, status__in=[Run.Status.RUNNING, Run.Status.RESUMING])
                .update(last_heartbeat=timezone.now()))


def _complete_locked(run: Run, *, actor=None, reason: str = "") -> Run:
    before = _snapshot(run)
    _apply(run, "complete")
    agents = Agent.objects.filter(run=run, attempt_number=run.attempt_number)
    if agents.filter(status__in=LIVE_NODE_STATES).exists() or not agents.filter(status=NodeStatus.COMPLETED).exists():
        raise InvalidTransition(entity="run", entity_id=run.pk, current=before["status"], requested="complete",
                                why="not every agent is done with at least one completed")
    attempt = _current_attempt(run)
    _settle(run, attempt, actor=actor, reason=reason)
    now = timezone.now()
    run.completed_at = now
    run.duration_ms = _duration_ms(run, now)
    run.status_reason = ""
    _close_attempt(run, attempt, outcome=Run.Status.COMPLETED)
    _record_run_change(run, before=before, action="complete", actor=actor, reason=reason)
    return run


@transaction.atomic
def run_complete(*, run_id: int, actor=None, reason: str = "") -> Run:
    """running → completed once every agent is done: release the unused reservation.

    Already completed: returns the run unchanged.
    """
    run = _lock_run(run_id)
    if run.status == Run.Status.COMPLETED:
        return run
    return _complete_locked(run, actor=actor, reason=reason)


def _fail_locked(run: Run, *, code: str, message: str, actor=None, reason: str = "", action: str = "fail") -> Run:
    before = _snapshot(run)
    _apply(run, "fail")
    attempt = _current_attempt(run)
    _terminate_live_nodes(run, attempt_number=run.attempt_number)
    _settle(run, attempt, actor=actor, reason=reason)
    now = timezone.now()
    run.last_error_code = code
    run.last_error = message
    run.completed_at = now
    run.duration_ms = _duration_ms(run, now)
    _close_attempt(run, attempt, outcome=Run.Status.FAILED, error_code=code)
    _record_run_change(run, before=before, action=action, actor=actor, reason=reason)
    return run


@transaction.atomic
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


class RunNotStuck(InvalidTransition):
    """The run is running and its worker is alive (or its work waits in the queue): nothing to recover."""

    code = "run_not_stuck"


@transaction.atomic
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


@transaction.atomic
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
        for node in model.objects.filter(run=run, status__in=[NodeStatus.PENDING, NodeStatus.RUNNING], **filters):
            _node_move(node, "pause", run=run, emit=False)
    run.status_reason = status_reason or "paused"
    _record_run_change(run, before=before, action="pause", actor=actor, reason=reason)
    return run


@transaction.atomic
def run_resume(*, run_id: int, actor=None, reason: str = "") -> Run:
    """paused → resuming: paused agents, tasks and steps back to pending; a worker then moves
    the run to running. Already resuming: no-op.
    """
    run = _lock_run(run_id)
    if run.status == Run.Status.RESUMING:
        return run
    if run.gated and run.status == Run.Status.PAUSED:
        pipeline.drift_refuse_unacknowledged(run)  # a stopped_drift run waits for an acknowledgment
    before = _snapshot(run)
    _apply(run, "resume")
    for model, filters in ((Agent, {"attempt_number": run.attempt_number}),
                           (Task, {"agent__attempt_number": run.attempt_number}),
                           (Step, {"task__agent__attempt_number": run.attempt_number})):
        for node in model.objects.filter(run=run, status=NodeStatus.PAUSED, **filters):
            _node_move(node, "unpause", run=run, emit=False)
    run.status_reason = ""
    _record_run_change(run, before=before, action="resume", actor=actor, reason=reason)
    _dispatch_after_commit(run.pk)
    return run


def _end_cancelled(run: Run, *, actor, reason: str) -> RunAttempt | None:
    """A run just moved to cancelled (cancel or void): end its live agents, release every credit
    not charged and stamp the end. Returns the attempt, for the caller to close."""
    attempt = _current_attempt(run)
    _terminate_live_nodes(run, attempt_number=run.attempt_number)
    _settle(run, attempt, actor=actor, reason=reason)
    now = timezone.now()
    run.cancelled_at = now
    run.duration_ms = _duration_ms(run, now)
    return attempt


@transaction.atomic
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
    released = (pipeline.pipeline_keys_release(run, reason=f"cancelled: {reason}" if reason else "cancelled")
                if run.gated else [])
    voided = _approvals_void(run, reason=reason or "cancelled") if run.gated else 0
    if run.status_reason.startswith("awaiting_approval:"):  # nothing waits for that approval any more
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


VOIDED_PREFIX = "voided:"


@transaction.atomic
def run_void(*, run_id: int, actor=None, reason: str) -> Run:
    """paused|failed → cancelled with the status reason ``voided:<reason>`` (seed 002's void): end
    live agents, release every credit not charged, release the run's phase idempotency keys (a
    new run may claim them) and void its pending approval requests. Already voided: no-op.
    """
    reason = (reason or "").strip()
    if not reason:
        raise ValidationFailed("a reason is required", errors={"reason": ["must not be empty"]})
    run = _lock_run(run_id)
    if run.status == Run.Status.CANCELLED and run.status_reason.startswith(VOIDED_PREFIX):
        return run
    if not can_proceed(run.void):
        raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="void",
                                why="only a stopped run (paused or failed) can be voided")
    before = _snapshot(run)
    run.void()
    attempt = _end_cancelled(run, actor=actor, reason=reason)
    run.status_reason = f"{VOIDED_PREFIX}{reason}"[:200]
    if attempt is not None and not attempt.outcome:
        _close_attempt(run, attempt, outcome=Run.Status.CANCELLED, error_code="voided")
    released = pipeline.pipeline_keys_release(run, reason=f"voided: {reason}")
    voided = _approvals_void(run, reason=f"voided: {reason}")
    _record_run_change(run, before=before, action="void", actor=actor, reason=reason,
                       extra={"released_keys": released, "voided_approvals": voided})
    return run


def _retry_locked(run: Run, *, actor=None, reason: str = "") -> Run:
    before = _snapshot(run)
    _apply(run, "retry")
    attempt = RunAttempt.objects.create(run=run, number=run.attempt_number)
    _reserve(run, attempt, actor=actor, reason=reason)
    run.status_reason = ""
    _record_run_change(run, before=before, action="retry", actor=actor, reason=reason)
    _dispatch_after_commit(run.pk)
    return run


@transaction.atomic
def run_retry(*, run_id: int, actor=None, reason: str = "") -> Run:
    """failed → retrying while ``attempt_number < max_attempts``: a new attempt with a new
    reservation; earlier agents, tasks and steps stay for audit. Already retrying: no-op.
    """
    run = _lock_run(run_id)
    if run.status == Run.Status.RETRYING:
        return run
    return _retry_locked(run, actor=actor, reason=reason)


@transaction.atomic
def run_requeue(*, run_id: int) -> Run:
    """retrying → pending: the new attempt waits for a worker. Already pending: no-op."""
    run = _lock_run(run_id)
    if run.status == Run.Status.PENDING:
        return run
    before = _snapshot(run)
    _apply(run, "requeue")
    _record_run_change(run, before=before, action="requeue")
    return run


@transaction.atomic
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
    event_record(type="run_deleted", organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                 payload={"run": run.pk, "reason": reason})
    audit_record(actor=actor, action="run_delete", target_type="run", target_id=run.pk,
                 organization_id=run.organization_id, run_id=run.pk, reason=reason, before=before,
                 after={**_snapshot(run), "deleted": True})
    return run


@transaction.atomic
def run_refund(*, run_id: int, amount: int | None = None, actor=None, reason: str,
               idempotency_key: str | None = None) -> int:
    """Give charged credits of a settled run back to its organization (full or partial).

    Never more than the run's net charge. Returns the amount refunded (0 on a repeated key).
    """
    if not (reason or "").strip():
        raise ValidationFailed("a reason is required", errors={"reason": ["must not be empty"]})
    run = _lock_run(run_id)
    if run.status not in (Run.Status.COMPLETED, Run.Status.FAILED, Run.Status.CANCELLED):
        raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="refund",
                                why="only completed, failed or cancelled runs can be refunded")
    key = idempotency_key or f"manual:{uuid.uuid4().hex}"
    # A refund spread over several attempts is written under per-attempt keys: look for all of them,
    # before checking the amount (a repeated request answers 0 even once nothing is left to refund).
    attempt_keys = [f"{key}:attempt:{n}" for n in RunAttempt.objects.filter(run=run).values_list("number", flat=True)]
    if LedgerEntry.objects.filter(run_id=run.pk, kind=LedgerEntry.Kind.REFUND,
                                  idempotency_key__in=[key, *attempt_keys]).exists():
        return 0
    refundable = run.credits_charged
    if amount is None:
        amount = refundable
    if isinstance(amount, bool) or not isinstance(amount, int) or amount <= 0:
        raise ValidationFailed("refund amount must be positive", errors={"amount": ["must be greater than zero"]})
    if amount > refundable:
        raise ValidationFailed(f"cannot refund {amount}: only {refundable} charged and not yet refunded",
                               errors={"amount": [f"at most {refundable}"]})
    before = _snapshot(run)
    left = amount
    for attempt in RunAttempt.objects.filter(run=run).order_by("-number"):
        take = min(left, attempt.credits_charged)
        if take <= 0:
            continue
        ledger_refund(organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                      attempt_number=attempt.number, amount=take, source=LedgerEntry.Source.CHARGE,
                      idempotency_key=f"{key}:attempt:{attempt.number}" if take != amount else key,
                      actor=actor, reason=reason)
        attempt.credits_charged -= take
        attempt.credits_refunded += take
        attempt.save(update_fields=["credits_charged", "credits_refunded"])
        left -= take
        if left == 0:
            break
    run.credits_charged -= amount
    run.credits_refunded += amount
    run.save(update_fields=["credits_charged", "credits_refunded", "updated_at"])
    event_record(type="run_refunded", organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                 payload={"run": run.pk, "amount": amount, "reason": reason})
    audit_record(actor=actor, action="run_refund", target_type="run", target_id=run.pk,
                 organization_id=run.organization_id, run_id=run.pk, reason=reason, before=before,
                 after=_snapshot(run))
    return amount


# --- steps, tasks, agents -----------------------------------------------------------------

def step_backoff_ms(tries_done: int, *, rng: random.Random | None = None) -> int:
    """Seed 001 §6.1: 100 ms · 2^n, capped at 30 s, ±10 % jitter (n = failed tries so far - 1)."""
    delay = min(STEP_BACKOFF_BASE_MS * (2 ** max(0, tries_done - 1)), STEP_BACKOFF_CAP_MS)
    jitter = delay * 0.1 * (2 * (rng or random).random() - 1)
    return int(delay + jitter)


def _step_idempotency_key(run: Run, step: Step, number: int) -> str:
    return f"run:{run.pk}:attempt:{run.attempt_number}:step:{step.pk}:try:{number}"


def runnable_steps(run: Run, *, now=None) -> list[Step]:
    """Steps of the current attempt that may start now, by the parallelism rules of each level.

    Agents run in parallel up to ``max_agents``; an agent's tasks by its ``parallelism_mode``
    (sequential, parallel up to 5, dag by ``depends_on``); a task's steps sequential or
    parallel up to 3. Steps waiting out a backoff (``not_before``) are not runnable yet.
    """
    now = now or timezone.now()
    if run.status != Run.Status.RUNNING:
        return []
    agents = list(Agent.objects.filter(run=run, attempt_number=run.attempt_number).order_by("sequence"))
    tasks = list(Task.objects.filter(run=run, agent__attempt_number=run.attempt_number).order_by("agent_id", "sequence"))
    steps = list(Step.objects.filter(run=run, task__agent__attempt_number=run.attempt_number)
                 .order_by("task_id", "sequence"))
    tasks_by_agent: dict[int, list[Task]] = {}
    for task in tasks:
        tasks_by_agent.setdefault(task.agent_id, []).append(task)
    steps_by_task: dict[int, list[Step]] = {}
    for step in steps:
        steps_by_task.setdefault(step.task_id, []).append(step)
    running_agents = sum(1 for a in agents if a.status == NodeStatus.RUNNING)
    result: list[Step] = []
    for agent in agents:
        if agent.status not in (NodeStatus.PENDING, NodeStatus.RUNNING):
            continue
        if agent.status == NodeStatus.PENDING:
            if running_agents >= run.max_agents:
                continue
        agent_tasks = tasks_by_agent.get(agent.pk, [])
        by_name = {t.name: t for t in agent_tasks}
        candidates: list[Task] = []
        if agent.parallelism_mode == ParallelismMode.SEQUENTIAL:
            for task in agent_tasks:
                if task.status in DONE_NODE_STATES:
                    continue
                candidates = [task]
                break
        elif agent.parallelism_mode == ParallelismMode.PARALLEL:
            live = [t for t in agent_tasks if t.status in (NodeStatus.PENDING, NodeStatus.RUNNING)]
            busy = sum(1 for t in live if t.status == NodeStatus.RUNNING)
            candidates = [t for t in live if t.status == NodeStatus.RUNNING]
            candidates += [t for t in live if t.status == NodeStatus.PENDING][: max(0, 5 - busy)]
        else:
            for task in agent_tasks:
                if task.status not in (NodeStatus.PENDING, NodeStatus.RUNNING):
                    continue
                if all(by_name[d].status == NodeStatus.COMPLETED for d in task.depends_on if d in by_name):
                    candidates.append(task)
        found_before = len(result)
        for task in candidates:
            if task.status not in (NodeStatus.PENDING, NodeStatus.RUNNING):
                continue
            task_steps = steps_by_task.get(task.pk, [])
            if task.parallelism_mode == ParallelismMode.PARALLEL:
                busy = sum(1 for s in task_steps if s.status == NodeStatus.RUNNING)
                ready = [s for s in task_steps if s.status == NodeStatus.PENDING
                         and (s.not_before is None or s.not_before <= now)]
                result.extend(ready[: max(0, 3 - busy)])
            else:
                for step in task_steps:
                    if step.status in DONE_NODE_STATES:
                        continue
                    if step.status == NodeStatus.PENDING and (step.not_before is None or step.not_before <= now):
                        result.append(step)
                    break
        if agent.status == NodeStatus.PENDING and len(result) > found_before:
            running_agents += 1
    return result


@dataclass(frozen=True)
class StepOutcome:
    """What happened to a step attempt: ``completed``, ``retry`` (with delay), ``failed``, ``discarded``
    (a late result: nothing recorded, nothing charged) or ``replayed`` (already recorded once)."""

    decision: str
    step_id: int
    delay_ms: int = 0
    error_code: str = ""


@transaction.atomic
def step_begin(*, step_id: int) -> StepAttempt:
    """pending → running for a runnable step (and its task and agent): a new ``StepAttempt``
    whose idempotency key names run, attempt, step and try.
    """
    try:
        run_id = Step.objects.values_list("run_id", flat=True).get(pk=step_id)
    except Step.DoesNotExist as exc:
        raise NotFound(f"step {step_id} does not exist") from exc
    run = _lock_run(run_id)
    step = Step.objects.select_related("task__agent").get(pk=step_id)
    if run.status != Run.Status.RUNNING:
        raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="begin step",
                                why=f"step {step_id} can only start while the run is running")
    if step.pk not in {s.pk for s in runnable_steps(run)}:
        raise InvalidTransition(entity="step", entity_id=step.pk, current=step.status, requested="begin",
                                why="not runnable now (order, dependencies, limits or backoff)")
    task, agent = step.task, step.task.agent
    if agent.status == NodeStatus.PENDING:
        _node_move(agent, "begin", run=run)
    if task.status == NodeStatus.PENDING:
        _node_move(task, "begin", run=run)
    step.attempts += 1
    step.tries_this_round += 1
    step.not_before = None
    _node_move(step, "begin", run=run)
    attempt = StepAttempt.objects.create(run=run, step=step, number=step.attempts,
                                         idempotency_key=_step_idempotency_key(run, step, step.attempts))
    run.last_heartbeat = timezone.now()
    run.save(update_fields=["last_heartbeat", "updated_at"])
    return attempt


def _load_attempt(attempt_id: int) -> tuple[Run, StepAttempt, Step]:
    try:
        run_id = StepAttempt.objects.values_list("run_id", flat=True).get(pk=attempt_id)
    except StepAttempt.DoesNotExist as exc:
        raise NotFound(f"step attempt {attempt_id} does not exist") from exc
    run = _lock_run(run_id)
    attempt = StepAttempt.objects.get(pk=attempt_id)
    step = Step.objects.select_related("task__agent").get(pk=attempt.step_id)
    return run, attempt, step


def _attempt_is_current(run: Run, attempt: StepAttempt, step: Step) -> bool:
    return (attempt.outcome == StepAttempt.Outcome.RUNNING and step.attempts == attempt.number
            and step.status in (NodeStatus.RUNNING, NodeStatus.PAUSED)
            and run.status in (Run.Status.RUNNING, Run.Status.PAUSED, Run.Status.RESUMING)
            and step.task.agent.attempt_number == run.attempt_number)


def _outcome_of_settled(attempt: StepAttempt, step: Step) -> StepOutcome:
    """A result for an attempt already settled: discarded stays discarded, anything else is a replay."""
    if attempt.outcome == StepAttempt.Outcome.DISCARDED:
        return StepOutcome("discarded", step.pk)
    return StepOutcome("replayed", step.pk)


def _discard(attempt: StepAttempt) -> None:
    if attempt.outcome == StepAttempt.Outcome.RUNNING:
        attempt.outcome = StepAttempt.Outcome.DISCARDED
        attempt.finished_at = timezone.now()
        attempt.save(update_fields=["outcome", "finished_at"])


def _step_cost(step: Step, run: Run) -> int:
    """A tool's cost per attempt; gates, and every step of a dry run, cost nothing."""
    tool = tool_get(step.tool) if step.kind == Step.Kind.TOOL and run.mode != "dryrun" else None
    return tool.cost if tool else 0


@transaction.atomic
def step_attempt_succeed(*, attempt_id: int, output: Any = None) -> StepOutcome:
    """Record a successful attempt: charge its cost, complete the step, propagate upwards.

    A late result (run cancelled or failed, step retried meanwhile) is discarded. A cost past
    the attempt's reservation fails the step with ``credit_limit_exceeded`` (not retryable).
    """
    run, attempt, step = _load_attempt(attempt_id)
    if attempt.outcome != StepAttempt.Outcome.RUNNING:
        return _outcome_of_settled(attempt, step)
    if not _attempt_is_current(run, attempt, step):
        _discard(attempt)
        return StepOutcome("discarded", step.pk)
    run_attempt = _current_attempt(run)
    cost = _step_cost(step, run)
    if cost:
        try:
            _charge(run, run_attempt, amount=cost, key=attempt.idempotency_key, reason=f"step {step.name}")
        except CreditLimitExceeded as exc:
            return _attempt_failed(run, attempt, step, code="credit_limit_exceeded", message=exc.detail,
                                   retryable=False, charge=False)
    attempt.outcome = StepAttempt.Outcome.SUCCEEDED
    attempt.cost = cost
    attempt.finished_at = timezone.now()
    attempt.save(update_fields=["outcome", "cost", "finished_at"])
    step.output = output
    step.credits_charged += cost
    _node_move(step, "complete", run=run)
    run.save(update_fields=["credits_charged", "updated_at"])
    if run.gated:
        pipeline.step_pins_record(run, step)
    _after_step_done(run, step.task)
    return StepOutcome("completed", step.pk)


@transaction.atomic
def step_attempt_fail(*, attempt_id: int, code: str, message: str, retryable: bool) -> StepOutcome:
    """Record a failed attempt (its cost is charged). Retryable with tries left → the step waits
    out seed 001's backoff; otherwise the step fails and the failure propagates by failure mode.
    """
    run, attempt, step = _load_attempt(attempt_id)
    if attempt.outcome != StepAttempt.Outcome.RUNNING:
        return _outcome_of_settled(attempt, step)
    if not _attempt_is_current(run, attempt, step):
        _discard(attempt)
        return StepOutcome("discarded", step.pk)
    return _attempt_failed(run, attempt, step, code=code or "error", message=message or code, retryable=retryable,
                           charge=True)


@transaction.atomic
def step_attempt_abandon(*, attempt_id: int) -> StepOutcome:
    """Drop an attempt interrupted by pause or cancel (or a gate waiting for approval): nothing is
    charged, the try is not counted; a step still running goes back to pending (paused when the
    run is paused) and runs again with a new attempt later."""
    run, attempt, step = _load_attempt(attempt_id)
    if attempt.outcome != StepAttempt.Outcome.RUNNING:
        return _outcome_of_settled(attempt, step)
    _discard(attempt)
    if step.attempts == attempt.number and step.status in (NodeStatus.RUNNING, NodeStatus.PAUSED):
        step.tries_this_round = max(0, step.tries_this_round - 1)
        step.not_before = None
        paused = step.status == NodeStatus.PAUSED or run.status == Run.Status.PAUSED
        _node_move(step, "reset", run=run, emit=False)
        if paused:
            _node_move(step, "pause", run=run, emit=False)
    return StepOutcome("discarded", step.pk)


def _attempt_failed(run: Run, attempt: StepAttempt, step: Step, *, code: str, message: str, retryable: bool,
                    charge: bool) -> StepOutcome:
    cost = _step_cost(step, run) if charge else 0
    if cost:
        try:
            _charge(run, _current_attempt(run), amount=cost, key=attempt.idempotency_key, reason=f"step {step.name}")
        except CreditLimitExceeded as exc:
            cost, code, message, retryable = 0, "credit_limit_exceeded", exc.detail, False
    attempt.outcome = StepAttempt.Outcome.FAILED
    attempt.cost = cost
    attempt.retryable = retryable
    attempt.error_code = code
    attempt.error = message
    attempt.finished_at = timezone.now()
    attempt.save()
    for hook in STEP_FAILURE_HOOKS:
        transaction.on_commit(lambda hook=hook, attempt_id=attempt.pk: hook(attempt_id))
    step.credits_charged += cost
    step.last_error_code, step.last_error = code, message
    if cost:
        run.save(update_fields=["credits_charged", "updated_at"])
    from runs.escalations import escalations_evaluate

    uncapped = STEP_BACKOFF_BASE_MS * (2 ** max(0, step.tries_this_round - 1)) if retryable else None
    escalations_evaluate(run=run, failed_attempt=attempt, uncapped_delay_ms=uncapped, cap_ms=STEP_BACKOFF_CAP_MS,
                         retries_exhausted=retryable and step.tries_this_round >= step.max_tries)
    if retryable and step.tries_this_round < step.max_tries:
        delay = step_backoff_ms(step.tries_this_round)
        step.not_before = timezone.now() + timedelta(milliseconds=delay)
        _node_move(step, "reset", run=run, emit=False)
        if run.status == Run.Status.PAUSED:
            _node_move(step, "pause", run=run, emit=False)
        _node_event(step, before=NodeStatus.RUNNING, run=run,
                    extra={"retry_in_ms": delay, "try": step.tries_this_round, "error": {"code": code,
                                                                                          "message": message}})
        return StepOutcome("retry", step.pk, delay_ms=delay, error_code=code)
    _node_move(step, "fail", run=run, error=(code, message))
    _after_step_failed(run, step)
    return StepOutcome("failed", step.pk, error_code=code)


def _reset_steps(run: Run, task: Task) -> None:
    steps = Step.objects.filter(task=task)
    _discard_open_attempts(run, steps)
    for step in steps:
        step.tries_this_round = 0
        step.not_before = None
        step.output = None
        _node_move(step, "reset", run=run, emit=False)


def _after_step_failed(run: Run, step: Step) -> None:
    task = Task.objects.select_related("agent").get(pk=step.task_id)
    error = (step.last_error_code, f"step {step.name}: {step.last_error}")
    # Seed 001 §3.4 rule 3: levels retry transient failures only (a retryable error that
    # exhausted the step's tries), never a fatal one or an exceeded credit limit.
    transient = StepAttempt.objects.filter(step=step).order_by("-number").values_list(
        "retryable", flat=True).first() is True
    if task.failure_mode == FailureMode.CONTINUE:
        _after_step_done(run, task)
    elif task.failure_mode == FailureMode.RETRY and transient and task.retry_count < MAX_RETRIES_PER_LEVEL:
        task.retry_count += 1
        _reset_steps(run, task)
        _node_move(task, "reset", run=run)
    else:
        _task_failed(run, task, error, transient=transient)


def _end_children(run: Run, nodes) -> None:
    """Not started → skipped; started → cancelled (their late results are discarded)."""
    for node in nodes:
        if node.status in (NodeStatus.PENDING, NodeStatus.PAUSED) and node.started_at is None:
            _node_move(node, "skip", run=run, emit=False)
        elif node.status in LIVE_NODE_STATES:
            _node_move(node, "cancel", run=run, emit=False)


def _task_failed(run: Run, task: Task, error: tuple[str, str], *, transient: bool = False) -> None:
    steps = Step.objects.filter(task=task, status__in=LIVE_NODE_STATES)
    _discard_open_attempts(run, steps)
    _end_children(run, steps)
    _node_move(task, "fail", run=run, error=error)
    agent = Agent.objects.get(pk=task.agent_id)
    error = (error[0], f"task {task.name}: {error[1]}")
    if agent.failure_mode == FailureMode.CONTINUE:
        _settle_agent_if_done(run, agent)
    elif agent.failure_mode == FailureMode.RETRY and transient and agent.retry_count < MAX_RETRIES_PER_LEVEL:
        agent.retry_count += 1
        for sibling in Task.objects.filter(agent=agent):
            _reset_steps(run, sibling)
            sibling.retry_count = 0
            _node_move(sibling, "reset", run=run, emit=False)
        _node_move(agent, "reset", run=run)
    else:
        _agent_failed(run, agent, error, transient=transient)


def _agent_failed(run: Run, agent: Agent, error: tuple[str, str], *, transient: bool = False) -> None:
    tasks = Task.objects.filter(agent=agent, status__in=LIVE_NODE_STATES)
    steps = Step.objects.filter(task__agent=agent, status__in=LIVE_NODE_STATES)
    _discard_open_attempts(run, steps)
    _end_children(run, steps)
    _end_children(run, tasks)
    _node_move(agent, "fail", run=run, error=error)
    if _replan(run):
        return
    _run_after_agent_failed(run, code=error[0], message=f"agent {agent.name}: {error[1]}", transient=transient)


def _replan(run: Run) -> bool:
    """Seed 001 §6.4: on significant failure let the planner add a new decomposition of the
    failed work to the current attempt (at most ``MAX_REPLANS`` times). True when it did."""
    from runs.planner import MAX_REPLANS, PLANNER, replan_needed

    if run.gated:  # a gated pipeline's phases, checks and keys are its contract: it fails, never re-plans
        return False
    if run.status != Run.Status.RUNNING or run.replan_count >= MAX_REPLANS or not replan_needed(run):
        return False
    failed = list(Agent.objects.filter(run=run, attempt_number=run.attempt_number, status=NodeStatus.FAILED))
    specs = PLANNER.replan(run, failed)
    if not specs:
        return False
    next_sequence = Agent.objects.filter(run=run, attempt_number=run.attempt_number).count()
    _spawn_agents(run, specs, first_sequence=next_sequence)
    run.replan_count += 1
    run.save(update_fields=["replan_count", "updated_at"])
    event_record(type="run_replanned", organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                 payload={"run": run.pk, "replan_count": run.replan_count, "failed_agents": [a.name for a in failed],
                          "new_agents": [spec["name"] for spec in specs]})
    transition_log(entity="run", id=run.pk, project=run.project_id, attempt=run.attempt_number, action="replan",
                   **{"from": run.status, "to": run.status}, reason=f"replan {run.replan_count}")
    return True


def _run_after_agent_failed(run: Run, *, code: str, message: str, transient: bool = False) -> None:
    """Apply the run's failure mode to a failed agent. A paused run cannot fail: ``run_mark_running``
    applies it when the run resumes. Automatic run retries stop after ``MAX_RETRIES_PER_LEVEL``.
    """
    if run.failure_mode == FailureMode.CONTINUE:
        _settle_run_if_done(run)
        return
    if run.status in (Run.Status.PAUSED, Run.Status.RESUMING):
        _defer_failure_while_paused(run, code=code)
        return
    if run.status not in (Run.Status.RUNNING,):
        return
    _fail_locked(run, code=code, message=message)
    if (run.failure_mode == FailureMode.RETRY and transient and run.has_attempts_left()
            and run.attempt_number <= MAX_RETRIES_PER_LEVEL):
        try:
            with transaction.atomic():
                _retry_locked(run, reason=f"automatic retry after {code}")
        except InsufficientCredits as exc:
            run.refresh_from_db()
            event_record(type="run_retry_refused", organization_id=run.organization_id, project_id=run.project_id,
                         run_id=run.pk, payload={"run": run.pk, "reason": exc.detail})


def _after_step_done(run: Run, task: Task) -> None:
    """Complete (or skip) a task whose steps are all done, then look at its agent."""
    task.refresh_from_db()
    if task.status not in LIVE_NODE_STATES:
        return
    statuses = list(Step.objects.filter(task=task).values_list("status", flat=True))
    if any(s in LIVE_NODE_STATES for s in statuses):
        return
    if NodeStatus.COMPLETED in statuses and task.status in (NodeStatus.RUNNING, NodeStatus.PAUSED):
        _node_move(task, "complete", run=run)
    else:
        _node_move(task, "skip", run=run)
    _settle_agent_if_done(run, Agent.objects.get(pk=task.agent_id))


def _settle_agent_if_done(run: Run, agent: Agent) -> None:
    agent.refresh_from_db()
    if agent.status not in LIVE_NODE_STATES:
        return
    tasks = list(Task.objects.filter(agent=agent))
    # In a DAG, a task whose dependency did not complete can never run: skip it (transitively).
    changed = True
    while changed:
        changed = False
        by_name = {t.name: t for t in tasks}
        for task in tasks:
            if task.status == NodeStatus.PENDING and any(
                d in by_name and by_name[d].status in (NodeStatus.FAILED, NodeStatus.SKIPPED, NodeStatus.CANCELLED)
                for d in task.depends_on
            ):
                _end_children(run, Step.objects.filter(task=task, status__in=LIVE_NODE_STATES))
                _node_move(task, "skip", run=run)
                changed = True
    if any(t.status in LIVE_NODE_STATES for t in tasks):
        return
    if any(t.status == NodeStatus.COMPLETED for t in tasks) and agent.status in (NodeStatus.RUNNING,
                                                                                  NodeStatus.PAUSED):
        _node_move(agent, "complete", run=run)
    else:
        _node_move(agent, "skip", run=run)
    _settle_run_if_done(run)


def _settle_run_if_done(run: Run) -> None:
    """A running run whose agents are all done completes (or fails when none completed)."""
    if run.status != Run.Status.RUNNING:
        return
    statuses = list(Agent.objects.filter(run=run, attempt_number=run.attempt_number).values_list("status", flat=True))
    if not statuses or any(s in LIVE_NODE_STATES for s in statuses):
        return
    if NodeStatus.COMPLETED in statuses:
        _complete_locked(run)
    else:
        _fail_locked(run, code="no_agent_completed", message="every agent failed or was skipped")
