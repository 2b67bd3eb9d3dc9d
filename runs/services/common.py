"""What every run service shares: the run's row lock, the before/after snapshot and its audit and
event records, node moves, the hooks other apps register, and the spawning of a plan's hierarchy.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django_fsm import can_proceed

from core.errors import (
    InvalidTransition,
)
from core.services import audit_record, event_record, row_lock, transition_log
from runs.events import node_event, run_event
from runs.models import (
    DONE_NODE_STATES,
    LIVE_NODE_STATES,
    MAX_RETRIES_PER_LEVEL,
    SETTLED_RUN_STATES,
    Agent,
    Artifact,
    FailureMode,
    ParallelismMode,
    Run,
    RunAttempt,
    Step,
    StepAttempt,
    Task,
)
from runs.pipeline import bookkeeping

# Called after commit with a run id whenever a run needs a worker (start, resume, retry).
# The execution engine registers itself here; nothing is called when none is registered.
RUN_DISPATCHERS: list[Callable[[int], None]] = []


# Called after commit with the id of every failed step attempt (diagnosis registers here).
STEP_FAILURE_HOOKS: list[Callable[[int], None]] = []


def _dispatch_after_commit(run_id: int) -> None:
    for dispatcher in RUN_DISPATCHERS:
        transaction.on_commit(lambda dispatcher=dispatcher: dispatcher(run_id))


def _lock_run(run_id: int) -> Run:
    return row_lock(Run, run_id, entity="run")


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
                       extra: dict | None = None, audit_after: dict | None = None) -> None:
    now = timezone.now()
    if before["status"] != run.status:
        run.status_changed_at = now
        if run.status in SETTLED_RUN_STATES:  # completed, failed or cancelled: its artifacts' time starts
            Artifact.objects.filter(run=run, expires_at__isnull=True).update(
                expires_at=now + timedelta(days=settings.ORCHESTRATOR_ARTIFACT_TTL_DAYS))
    run.save()
    bookkeeping.pipeline_clock(run, before_status=before["status"])
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
    event_record(type=run_event(run.status), organization_id=run.organization_id, project_id=run.project_id,
                 run_id=run.pk, payload=payload)
    if actor is not None:
        audit_record(actor=actor, action=f"run_{action}", target_type="run", target_id=run.pk,
                     organization_id=run.organization_id, run_id=run.pk, reason=reason, before=before,
                     after={**_snapshot(run), **(audit_after or {})})
    transition_log(entity="run", id=run.pk, project=run.project_id, attempt=run.attempt_number,
                   **{"from": before["status"], "to": run.status}, action=action, reason=reason or run.last_error_code)


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
    event_record(type=node_event(entity, node.status), organization_id=run.organization_id, project_id=run.project_id,
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
        bookkeeping.phase_moved(run, node, action=action)
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

