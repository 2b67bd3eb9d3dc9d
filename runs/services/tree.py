"""A run's tree of the current attempt: its agents, tasks and steps read under the run's lock in
one statement (or with the step attempt being settled and the run's attempt), built once per
transaction and kept on the run (``_run_tree``), one object per node."""

from __future__ import annotations

from django.db import connection

from core.sql import ModelRows, db, hot_cursor, per_vendor
from runs.models import Agent, Artifact, Run, RunAttempt, Step, StepAttempt, Task
from runs.outbox import run_atomic_scope

_ATTEMPT_ROWS = ModelRows(RunAttempt)


class RunTree:
    """The current attempt's agents, tasks and steps of a locked run, read in one query and kept on
    the run for the rest of the transaction (``_run_tree``). Every node is one object here (a step's
    ``task`` and a task's ``agent`` are the tree's own), so moves made on these objects keep it
    current; a move of another copy of a node drops the tree (``_node_move``), read again when
    next needed. A plan's agents and tasks are never empty, so the steps name every node."""

    def __init__(self, run: Run, *, steps: list[Step] | None = None):
        """``steps``: the attempt's steps just created (with their tasks and agents), not read again."""
        self.attempt_number = run.attempt_number
        self.agents: dict[int, Agent] = {}
        self.tasks: dict[int, Task] = {}
        self.steps: dict[int, Step] = {}
        for step in steps if steps is not None else self._read(run):
            task = self.tasks.setdefault(step.task_id, step.task)
            _related_set(task, "agent", self.agents.setdefault(task.agent_id, task.agent))
            _related_set(step, "task", task)
            self.steps[step.pk] = step
        self._tasks_of: dict[int, list[Task]] = {}
        for task in sorted(self.tasks.values(), key=lambda t: t.sequence):
            self._tasks_of.setdefault(task.agent_id, []).append(task)
        self._steps_of: dict[int, list[Step]] = {}
        for step in sorted(self.steps.values(), key=lambda s: s.sequence):
            self._steps_of.setdefault(step.task_id, []).append(step)

    def _read(self, run: Run) -> list[Step]:
        """The steps with their tasks and agents, one object per node, in one prepared statement."""
        with hot_cursor() as cursor:
            cursor.execute(_tree_sql(), [run.pk, run.pk, run.pk, run.attempt_number])
            return _tree_steps(cursor.fetchall())

    def agents_in_order(self) -> list[Agent]:
        return sorted(self.agents.values(), key=lambda a: a.sequence)

    def tasks_of(self, agent_id: int) -> list[Task]:
        return self._tasks_of.get(agent_id, [])

    def steps_of(self, task_id: int) -> list[Step]:
        return self._steps_of.get(task_id, [])

    def holds(self, node) -> bool:
        nodes = self.steps if isinstance(node, Step) else self.tasks if isinstance(node, Task) else self.agents
        return nodes.get(node.pk) is node


_STEP_ROWS, _TASK_ROWS, _AGENT_ROWS = ModelRows(Step), ModelRows(Task), ModelRows(Agent)
_TREE_WIDTH = _STEP_ROWS.width + _TASK_ROWS.width + _AGENT_ROWS.width


def _tree_steps(rows, start: int = 0) -> list[Step]:
    """The steps of rows holding a step's, its task's and its agent's columns from ``start`` (the tree
    statement's), one object per node; a row whose agent is NULL (an outer join's: no step, or a
    step of an earlier attempt) holds none."""
    tasks: dict[int, Task] = {}
    agents: dict[int, Agent] = {}
    steps = []
    task_at, agent_at = start + _STEP_ROWS.width, start + _STEP_ROWS.width + _TASK_ROWS.width
    task_pk, agent_pk = task_at + _TASK_ROWS.names.index("id"), agent_at + _AGENT_ROWS.names.index("id")
    conn = db()
    for row in rows:
        if row[agent_pk] is None:
            continue
        step = _STEP_ROWS.load(row, start, conn)
        task = tasks.get(row[task_pk])
        if task is None:
            task = tasks[row[task_pk]] = _TASK_ROWS.load(row, task_at, conn)
            agent = agents.get(row[agent_pk])
            if agent is None:
                agent = agents[row[agent_pk]] = _AGENT_ROWS.load(row, agent_at, conn)
            _related_set(task, "agent", agent)
        _related_set(step, "task", task)
        steps.append(step)
    return steps


def _related_set(node, name: str, parent) -> None:
    """``node.<name> = parent`` for a parent whose key the node's foreign key already holds (a tree
    read or built together), without the descriptor's checks: the related object's cache."""
    node._state.fields_cache[name] = parent


def _first_columns(rows: ModelRows, alias: str, over: str) -> str:
    """``rows.columns(alias)``, each but the key NULL in every row but the first of its window
    ``over``: a row repeated by a join (a task's on each of its steps) is sent, and parsed, once."""
    qn = connection.ops.quote_name
    return ", ".join(f"{alias}.{qn(field.column)}" if field.primary_key
                     else f"CASE WHEN ROW_NUMBER() OVER ({over}) = 1 THEN {alias}.{qn(field.column)} END"
                     for field in rows.fields)


def _tree_columns_sql(step: str, task: str, agent: str) -> str:
    """The tree's columns (a step's, its task's, its agent's), a task's and an agent's sent with its
    first step only (the statement orders its rows by step: ``_tree_steps`` loads a node from the
    first row that names it)."""
    return (f"{_STEP_ROWS.columns(step)}, {_first_columns(_TASK_ROWS, task, f'PARTITION BY {task}.id ORDER BY {step}.id')},"
            f" {_first_columns(_AGENT_ROWS, agent, f'PARTITION BY {agent}.id ORDER BY {step}.id')}")


@per_vendor
def _tree_sql() -> str:
    """The current attempt's nodes of a run: each table filtered by its own run index (the run's
    rows only, whatever the planner's statistics say: a fresh or just-grown table is never joined
    whole), in the order of the steps (the tree sorts its levels)."""
    qn = connection.ops.quote_name
    step, task, agent = (qn(model._meta.db_table) for model in (Step, Task, Agent))
    return (f"SELECT {_tree_columns_sql('s', 't', 'a')}"
            f" FROM {step} s INNER JOIN {task} t ON t.id = s.task_id INNER JOIN {agent} a ON a.id = t.agent_id"
            " WHERE s.run_id = %s AND t.run_id = %s AND a.run_id = %s AND a.attempt_number = %s ORDER BY s.id")


def _run_tree(run: Run) -> RunTree:
    """The run's tree: read once per ``run_atomic()`` transaction (again after a move made around
    it, or a new attempt); outside one, read at every call."""
    scope = run_atomic_scope()
    tree = run.__dict__.get("_tree")
    if tree is None or tree.scope is not scope or scope is None or tree.attempt_number != run.attempt_number:
        tree = RunTree(run)
        tree.scope = scope
        if scope is not None:
            run.__dict__["_tree"] = tree
    return tree


_STEP_ATTEMPT_ROWS = ModelRows(StepAttempt)


def _step_attempt_read(run: Run, attempt_id: int) -> StepAttempt | None:
    """A step attempt of a locked run (None when there is none), read with the run's current attempt
    and tree in one prepared statement: in a ``run_atomic()`` transaction both are kept on the run as
    ``_current_attempt`` and ``_run_tree`` keep them (read under the run's lock, as those read them)."""
    number = run.attempt_number
    with hot_cursor() as cursor:
        cursor.execute(_step_attempt_read_sql(), [run.pk, number, run.pk, run.pk, run.pk, run.pk, number, attempt_id])
        rows = cursor.fetchall()
    return _step_attempt_kept(run, rows, 0)


def _step_attempt_kept(run: Run, rows, at: int) -> StepAttempt | None:
    """The step attempt of rows holding its columns from ``at``, then the run's current attempt's,
    whether the run has artifacts without an expiry, and its tree's; the attempt, that answer and
    the tree kept on the run (in a ``run_atomic()`` transaction)."""
    if not rows or rows[0][at + _STEP_ATTEMPT_ROWS.names.index("id")] is None:
        return None
    attempt = _STEP_ATTEMPT_ROWS.load(rows[0], at)
    at += _STEP_ATTEMPT_ROWS.width
    scope = run_atomic_scope()
    if scope is not None:
        if rows[0][at + _ATTEMPT_ROWS.names.index("id")] is not None:
            run.__dict__["_attempt"] = (scope, run.attempt_number, _ATTEMPT_ROWS.load(rows[0], at))
        run.__dict__["_open_artifacts"] = (scope, bool(rows[0][at + _ATTEMPT_ROWS.width]))
    _run_tree_keep(run, _tree_steps(rows, at + _ATTEMPT_ROWS.width + 1))
    return attempt


def _open_artifacts_sql(run_id: str) -> str:
    """Whether the run ``run_id`` (SQL) has artifacts without an expiry (a column)."""
    qn = connection.ops.quote_name
    return (f"EXISTS (SELECT 1 FROM {qn(Artifact._meta.db_table)} x"
            f" WHERE x.run_id = {run_id} AND x.expires_at IS NULL)")


def _artifacts_open(run: Run) -> bool:
    """Whether the run may have artifacts without an expiry: not when the run's read under its lock
    in this ``run_atomic()`` transaction found none (``_step_attempt_kept``); artifacts are written
    outside the run services, never in their transactions."""
    known = run.__dict__.get("_open_artifacts")
    scope = run_atomic_scope()
    return not (scope is not None and known is not None and known[0] is scope and not known[1])


def _run_tree_keep(run: Run, steps: list[Step]) -> None:
    """Keep the tree of ``steps`` (the current attempt's, just read under the run's lock) on the run
    for the rest of the ``run_atomic()`` transaction (nothing outside one)."""
    scope = run_atomic_scope()
    if scope is not None:
        tree = RunTree(run, steps=steps)
        tree.scope = scope
        run.__dict__["_tree"] = tree


@per_vendor
def _step_attempt_read_sql() -> str:
    """A step attempt, whether a run has artifacts without an expiry, the run's attempt of a number and
    that attempt's tree (``_tree_sql``'s rows, an outer join: one row with none when it has no nodes
    yet)."""
    qn = connection.ops.quote_name
    step, task, agent = (qn(model._meta.db_table) for model in (Step, Task, Agent))
    first = "ORDER BY s.id"  # the attempts' columns in the first row only (``_step_attempt_kept`` reads it)
    return (f"SELECT {_first_columns(_STEP_ATTEMPT_ROWS, 'm', first)}, {_first_columns(_ATTEMPT_ROWS, 'a', first)},"
            f" {_open_artifacts_sql('%s')}, {_tree_columns_sql('s', 't', 'g')}"
            f" FROM {qn(StepAttempt._meta.db_table)} m"
            f" LEFT JOIN {qn(RunAttempt._meta.db_table)} a ON a.number = %s AND a.run_id = %s"
            f" LEFT JOIN ({step} s INNER JOIN {task} t ON t.id = s.task_id INNER JOIN {agent} g ON g.id = t.agent_id)"
            " ON s.run_id = %s AND t.run_id = %s AND g.run_id = %s AND g.attempt_number = %s"
            " WHERE m.id = %s ORDER BY s.id")


def _run_tree_forget(run: Run) -> None:
    run.__dict__.pop("_tree", None)
