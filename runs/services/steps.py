"""Step attempts and scheduling: which steps are runnable, a step attempt's begin, its success,
failure and abandonment (with its charge and backoff), each settled under the run's lock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing.errors import CreditLimitExceeded
from core.errors import (
    InvalidTransition,
    NotFound,
)
from core.fsm import save_moved_together
from core.sql import insert_returning
from jobs.registry import BACKOFF_CAP_MS, backoff_ms, backoff_uncapped_ms
from jobs.tools import tool_get
from runs.models import (
    DONE_NODE_STATES,
    Agent,
    NodeStatus,
    ParallelismMode,
    Run,
    Step,
    StepAttempt,
    Task,
)
from runs.outbox import run_atomic
from runs.pipeline import bookkeeping
from runs.services.common import (
    STEP_FAILURE_HOOKS,
    _current_attempt,
    _lock_run_of,
    _node_event,
    _node_move,
    _nodes_saved,
    _run_tree,
    _lock_run_of_step_attempt,
)
from runs.services.credits import _charge
from runs.services.propagation import _after_step_done, _after_step_failed


def step_backoff_ms(tries_done: int, *, rng: random.Random | None = None) -> int:
    """Seed 001 §6.1's backoff (``jobs.registry.backoff_ms``) before a step's next try (n = failed tries so far - 1)."""
    return backoff_ms(tries_done, rng=rng)


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
    tree = _run_tree(run)
    agents = tree.agents_in_order()
    running_agents = sum(1 for a in agents if a.status == NodeStatus.RUNNING)
    result: list[Step] = []
    for agent in agents:
        if agent.status not in (NodeStatus.PENDING, NodeStatus.RUNNING):
            continue
        if agent.status == NodeStatus.PENDING:
            if running_agents >= run.max_agents:
                continue
        agent_tasks = tree.tasks_of(agent.pk)
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
            task_steps = tree.steps_of(task.pk)
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


@run_atomic()
def step_begin(*, step_id: int, then: Callable[[Run, Step, StepAttempt], Any] | None = None) -> StepAttempt:
    """pending → running for a runnable step (and its task and agent): a new ``StepAttempt``
    whose idempotency key names run, attempt, step and try. ``then`` is called with the run
    (locked), the step and the attempt in the same transaction (the engine records the tool call
    there, after this begin's events).
    """
    run = _lock_run_of(Step, step_id, entity="step", tree=True)
    step = _run_tree(run).steps.get(step_id) or Step.objects.select_related("task__agent").get(pk=step_id)
    if run.status != Run.Status.RUNNING:
        raise InvalidTransition(entity="run", entity_id=run.pk, current=run.status, requested="begin step",
                                why=f"step {step_id} can only start while the run is running")
    if step.pk not in {s.pk for s in runnable_steps(run)}:
        raise InvalidTransition(entity="step", entity_id=step.pk, current=step.status, requested="begin",
                                why="not runnable now (order, dependencies, limits or backoff)")
    attempt = step_begin_locked(run, step)
    if then is not None:
        then(run, step, attempt)
    return attempt


# A begin or a settlement within this long of the run's last recorded heartbeat does not write
# another (``heartbeat_reuse``: at most a tenth of ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S, which is a
# minute by default). A settlement that leaves it alone leaves every indexed column of the run as it
# was, so that PostgreSQL updates the run in place (a HOT update: no entry in any of its indexes).
HEARTBEAT_REUSE = timedelta(seconds=5)


def heartbeat_reuse() -> timedelta:
    """How long a recorded heartbeat serves: ``HEARTBEAT_REUSE``, or a tenth of the timeout that
    reads it when that is shorter (a step that begins or settles finds its run's heartbeat at most
    that old; a step that runs longer is beaten for by its worker's heartbeat thread)."""
    return min(HEARTBEAT_REUSE, timedelta(seconds=settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S) / 10)


def heartbeat_due(run: Run, now) -> bool:
    """Whether ``run``'s heartbeat should be written at ``now`` (none yet, or older than the reuse)."""
    return run.last_heartbeat is None or now - run.last_heartbeat > heartbeat_reuse()


def heartbeat_record(run: Run, now) -> None:
    """Under the run's lock: save ``now`` as the run's heartbeat when one is due."""
    if heartbeat_due(run, now):
        run.last_heartbeat = now
        run.save(update_fields=["last_heartbeat", "updated_at"])


def step_begin_locked(run: Run, step: Step) -> StepAttempt:
    """``step_begin`` for a step the caller found runnable (``runnable_steps``) under the run's lock,
    in the caller's transaction (the engine begins the next step where it settled the last)."""
    task, agent = step.task, step.task.agent
    together = not run.gated  # a gated run's task keeps its phase record as it moves (reading the rows)
    moved = [node for node in (agent, task) if node.status == NodeStatus.PENDING]
    for node in moved:
        _node_move(node, "begin", run=run, save=not together)
    step.attempts += 1
    step.tries_this_round += 1
    step.not_before = None
    _node_move(step, "begin", run=run, save=not together)
    attempt = StepAttempt(run=run, step=step, number=step.attempts,
                          idempotency_key=_step_idempotency_key(run, step, step.attempts))
    if together:  # the agent's, the task's and the step's moves and the attempt: one statement (PostgreSQL)
        _nodes_saved([*moved, step], insert=attempt)
    else:
        insert_returning(attempt)
    heartbeat_record(run, timezone.now())
    return attempt


def _load_attempt(attempt_id: int) -> tuple[Run, StepAttempt, Step]:
    """The attempt, its step and its run (locked); the step is the run tree's own object when the
    attempt belongs to the current attempt of the run."""
    run, attempt = _lock_run_of_step_attempt(attempt_id)  # the attempt read under the run's lock: settled or not
    if attempt is None:
        raise NotFound(f"step attempt {attempt_id} does not exist")
    step = _run_tree(run).steps.get(attempt.step_id) or Step.objects.select_related("task__agent").get(
        pk=attempt.step_id)
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


def _attempt_to_settle(attempt_id: int) -> tuple[Run, StepAttempt, Step, StepOutcome | None]:
    """The attempt under its run's lock, with the outcome to answer at once when its result
    cannot apply: already settled (replayed or discarded), or stale (discarded now)."""
    run, attempt, step = _load_attempt(attempt_id)
    if attempt.outcome != StepAttempt.Outcome.RUNNING:
        return run, attempt, step, _outcome_of_settled(attempt, step)
    if not _attempt_is_current(run, attempt, step):
        _discard(attempt)
        return run, attempt, step, StepOutcome("discarded", step.pk)
    return run, attempt, step, None


def _discard(attempt: StepAttempt) -> None:
    if attempt.outcome == StepAttempt.Outcome.RUNNING:
        attempt.outcome = StepAttempt.Outcome.DISCARDED
        attempt.finished_at = timezone.now()
        attempt.save(update_fields=["outcome", "finished_at"])


def _step_cost(step: Step, run: Run) -> int:
    """A tool's cost per attempt; gates, and every step of a dry run, cost nothing."""
    tool = tool_get(step.tool) if step.kind == Step.Kind.TOOL and run.mode != "dryrun" else None
    return tool.cost if tool else 0


# ``then``: called with the run (still locked) and the outcome in the transaction that settled the
# attempt, whatever the outcome (the engine schedules the run's next steps there).
SettledHook = Callable[[Run, "StepOutcome"], None]


def _then(run: Run, outcome: StepOutcome, then: SettledHook | None) -> StepOutcome:
    if then is not None:  # a hook that lets another app write events flushes the batch first
        then(run, outcome)
    return outcome


def step_attempt_succeed(*, attempt_id: int, output: Any = None, then: SettledHook | None = None,
                         savepoint: bool = True) -> StepOutcome:
    """Record a successful attempt: charge its cost, complete the step, propagate upwards.

    A late result (run cancelled or failed, step retried meanwhile) is discarded. A cost past
    the attempt's reservation fails the step with ``credit_limit_exceeded`` (not retryable).
    ``savepoint=False``: called inside a transaction that fails as a whole with it (the command
    record's success), so no savepoint of its own.
    """
    with run_atomic(savepoint=savepoint):
        run, attempt, step, early = _attempt_to_settle(attempt_id)
        if early is not None:
            return _then(run, early, then)
        return _then(run, _succeeded(run, attempt, step, output), then)


def _succeeded(run: Run, attempt: StepAttempt, step: Step, output: Any) -> StepOutcome:
    run_attempt = _current_attempt(run)
    cost = _step_cost(step, run)
    if cost:
        try:  # the attempt's charged figure is saved below, or when the run settles and closes it
            _charge(run, run_attempt, amount=cost, key=attempt.idempotency_key, reason=f"step {step.name}",
                    save=False)
        except CreditLimitExceeded as exc:
            return _attempt_failed(run, attempt, step, code="credit_limit_exceeded", message=exc.detail,
                                   retryable=False, charge=False)
    now = timezone.now()
    attempt.outcome = StepAttempt.Outcome.SUCCEEDED
    attempt.cost = cost
    attempt.finished_at = now
    step.output = output
    step.credits_charged += cost
    _node_move(step, "complete", run=run, save=False)  # saved with the attempt (one statement)
    moves = [(attempt, ("outcome", "cost", "finished_at")), (step, step.MOVING_FIELDS)]
    # The run's figures and heartbeat (a worker settled a step of the run: it is alive) and the run
    # attempt's charged figure, kept with the moves before the propagation (a move of the run it
    # makes saves them again): all written in one statement.
    run.updated_at = now
    if heartbeat_due(run, now):
        run.last_heartbeat = now
    charged = [(run_attempt, ("credits_charged",))] if cost else []
    run_figures = [(run, ("credits_charged", "last_heartbeat", "updated_at"))]
    save_moved_together([*moves, *charged, *run_figures], put_off=True)
    if run.gated:
        bookkeeping.step_pins_record(run, step)
    _after_step_done(run, step.task)
    return StepOutcome("completed", step.pk)


@run_atomic()
def step_attempt_fail(*, attempt_id: int, code: str, message: str, retryable: bool,
                      then: SettledHook | None = None) -> StepOutcome:
    """Record a failed attempt (its cost is charged). Retryable with tries left → the step waits
    out seed 001's backoff; otherwise the step fails and the failure propagates by failure mode.
    """
    run, attempt, step, early = _attempt_to_settle(attempt_id)
    if early is not None:
        return _then(run, early, then)
    return _then(run, _attempt_failed(run, attempt, step, code=code or "error", message=message or code,
                                      retryable=retryable, charge=True), then)


@run_atomic()
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
    from runs.services.escalations import escalations_evaluate

    uncapped = backoff_uncapped_ms(step.tries_this_round) if retryable else None
    escalations_evaluate(run=run, failed_attempt=attempt, uncapped_delay_ms=uncapped, cap_ms=BACKOFF_CAP_MS,
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

