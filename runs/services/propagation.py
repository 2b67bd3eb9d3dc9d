"""Failure and completion propagation up the hierarchy: step → task → agent → run, by each level's
failure mode (fail-fast, continue, retry), with the re-plan of seed 001 §6.4.
"""

from __future__ import annotations


from billing.errors import InsufficientCredits
from core.services import transition_log
from runs.events import RUN_REPLANNED, RUN_RETRY_REFUSED
from runs.models import (
    LIVE_NODE_STATES,
    MAX_RETRIES_PER_LEVEL,
    Agent,
    FailureMode,
    NodeStatus,
    Run,
    Step,
    StepAttempt,
    Task,
)
from runs.outbox import run_atomic, run_event_record
from runs.plan import plan_cost_estimate
from runs.services.common import (
    _current_attempt,
    _discard_open_attempts,
    _node_move,
    _nodes_move,
    _run_tree,
    _spawn_agents,
)
from runs.services.credits import _reserve_replan
from runs.services.settlement import (
    _complete_locked,
    _defer_failure_while_paused,
    _fail_locked,
    _retry_locked,
)


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


def _reset_steps(run: Run, task: Task) -> None:
    steps = list(Step.objects.filter(task=task))
    _discard_open_attempts(run, Step.objects.filter(task=task))
    _nodes_move(steps, "reset", run=run, values={"tries_this_round": 0, "not_before": None, "output": None})


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
    """Not started → skipped; started → cancelled (their late results are discarded): one UPDATE each."""
    nodes = list(nodes)
    skipped = [n for n in nodes if n.status in (NodeStatus.PENDING, NodeStatus.PAUSED) and n.started_at is None]
    _nodes_move(skipped, "skip", run=run)
    _nodes_move([n for n in nodes if n not in skipped and n.status in LIVE_NODE_STATES], "cancel", run=run)


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
        siblings = list(Task.objects.filter(agent=agent))
        for sibling in siblings:
            _reset_steps(run, sibling)
        _nodes_move(siblings, "reset", run=run, values={"retry_count": 0})
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
    number = run.replan_count + 1
    cost = (plan_cost_estimate({"agents": specs}, tries_per_step=MAX_RETRIES_PER_LEVEL,
                               level_retries=MAX_RETRIES_PER_LEVEL) if run.mode != "dryrun" else 0)
    if cost:
        try:
            _reserve_replan(run, _current_attempt(run), amount=cost, replan_number=number)
        except InsufficientCredits as exc:
            if run.failure_mode == FailureMode.CONTINUE:
                return False  # the run goes on with the agents it has
            _fail_locked(run, code="insufficient_credits",
                         message=f"re-plan {number} of the failed work needs {cost} credits: {exc.detail}")
            return True
    next_sequence = Agent.objects.filter(run=run, attempt_number=run.attempt_number).count()
    _spawn_agents(run, specs, first_sequence=next_sequence)
    run.replan_count = number
    run.save(update_fields=["replan_count", "updated_at"])
    run_event_record(type=RUN_REPLANNED, organization_id=run.organization_id, project_id=run.project_id, run_id=run.pk,
                     payload={"run": run.pk, "replan_count": run.replan_count,
                              "failed_agents": [a.name for a in failed],
                              "new_agents": [spec["name"] for spec in specs], "credits_reserved": cost})
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
            with run_atomic():  # its events go when it does
                _retry_locked(run, reason=f"automatic retry after {code}")
        except InsufficientCredits as exc:
            run.refresh_from_db()
            run_event_record(type=RUN_RETRY_REFUSED, organization_id=run.organization_id, project_id=run.project_id,
                             run_id=run.pk, payload={"run": run.pk, "reason": exc.detail})


def _after_step_done(run: Run, task: Task) -> None:
    """Complete (or skip) a task whose steps are all done, then look at its agent."""
    tree = _run_tree(run)
    task = tree.tasks.get(task.pk) or _refreshed(task)
    if task.status not in LIVE_NODE_STATES:
        return
    statuses = [step.status for step in tree.steps_of(task.pk)] if task.pk in tree.tasks else list(
        Step.objects.filter(task=task).values_list("status", flat=True))
    if any(s in LIVE_NODE_STATES for s in statuses):
        return
    if NodeStatus.COMPLETED in statuses and task.status in (NodeStatus.RUNNING, NodeStatus.PAUSED):
        _node_move(task, "complete", run=run)
    else:
        _node_move(task, "skip", run=run)
    _settle_agent_if_done(run, task.agent if task.pk in tree.tasks else Agent.objects.get(pk=task.agent_id))


def _refreshed(node):
    node.refresh_from_db()
    return node


def _settle_agent_if_done(run: Run, agent: Agent) -> None:
    tree = _run_tree(run)
    if agent.pk in tree.agents:
        agent = tree.agents[agent.pk]
        tasks = tree.tasks_of(agent.pk)
    else:  # an agent of another attempt: read as it is now
        agent.refresh_from_db()
        tasks = list(Task.objects.filter(agent=agent))
    if agent.status not in LIVE_NODE_STATES:
        return
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
    statuses = [agent.status for agent in _run_tree(run).agents.values()]
    if not statuses or any(s in LIVE_NODE_STATES for s in statuses):
        return
    if NodeStatus.COMPLETED in statuses:
        _complete_locked(run)
    else:
        _fail_locked(run, code="no_agent_completed", message="every agent failed or was skipped")
