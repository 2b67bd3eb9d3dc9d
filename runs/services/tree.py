"""A run's tree of the current attempt: its agents, tasks and steps read under the run's lock in
one statement (or with the step attempt being settled and the run's attempt), built once per
transaction and kept on the run (``_run_tree``), one object per node."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection

from core.fsm import row_unsaved_move
from core.sql import ROW_VERSION, ROW_WRITTEN, ModelRows, db, hot_cursor, per_vendor
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
            return _tree_steps(cursor.fetchall(), versions_at=_TREE_WIDTH if _versioned() else None)

    def agents_in_order(self) -> list[Agent]:
        return sorted(self.agents.values(), key=lambda a: a.sequence)

    def tasks_of(self, agent_id: int) -> list[Task]:
        return self._tasks_of.get(agent_id, [])

    def steps_of(self, task_id: int) -> list[Step]:
        return self._steps_of.get(task_id, [])

    def nodes(self) -> Iterator:
        yield from self.steps.values()
        yield from self.tasks.values()
        yield from self.agents.values()

    def holds(self, node) -> bool:
        nodes = self.steps if isinstance(node, Step) else self.tasks if isinstance(node, Task) else self.agents
        return nodes.get(node.pk) is node


_STEP_ROWS, _TASK_ROWS, _AGENT_ROWS = ModelRows(Step), ModelRows(Task), ModelRows(Agent)
_TREE_WIDTH = _STEP_ROWS.width + _TASK_ROWS.width + _AGENT_ROWS.width


def _versioned() -> bool:
    """Whether the tree's reads carry each node's row version (PostgreSQL's ``xmin``)."""
    return db().vendor == "postgresql"


def _versions_sql(step: str, task: str, agent: str) -> str:
    """The row versions of a tree's row (its step's, task's and agent's ``xmin``), PostgreSQL only."""
    if connection.vendor != "postgresql":
        return ""
    return f", {step}.xmin::text, {task}.xmin::text, {agent}.xmin::text"


def _tree_steps(rows, start: int = 0, *, versions_at: int | None = None) -> list[Step]:
    """The steps of rows holding a step's, its task's and its agent's columns from ``start`` (the tree
    statement's), one object per node; a row whose agent is NULL (an outer join's: no step, or a
    step of an earlier attempt) holds none. ``versions_at``: where the row's versions are
    (``_versions_sql``), kept on the nodes (``core.sql.ROW_VERSION``)."""
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
                if versions_at is not None:
                    agent.__dict__[ROW_VERSION] = row[versions_at + 2]
            _related_set(task, "agent", agent)
            if versions_at is not None:
                task.__dict__[ROW_VERSION] = row[versions_at + 1]
        if versions_at is not None:
            step.__dict__[ROW_VERSION] = row[versions_at]
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
    tasks = _first_columns(_TASK_ROWS, task, f"PARTITION BY {task}.id ORDER BY {step}.id")
    agents = _first_columns(_AGENT_ROWS, agent, f"PARTITION BY {agent}.id ORDER BY {step}.id")
    return f"{_STEP_ROWS.columns(step)}, {tasks}, {agents}"


def _nodes_sql(step: str, task: str, agent: str) -> tuple[str, str]:
    """A run's attempt's nodes under these aliases: the steps joined to their tasks and agents, and
    the condition that keeps that run's (each table by its own run index: the run's rows only,
    whatever the planner's statistics say) of that attempt; its parameters the run's id three
    times and the attempt's number."""
    qn = connection.ops.quote_name
    steps, tasks, agents = (qn(model._meta.db_table) for model in (Step, Task, Agent))
    joined = (f"{steps} {step} INNER JOIN {tasks} {task} ON {task}.id = {step}.task_id"
              f" INNER JOIN {agents} {agent} ON {agent}.id = {task}.agent_id")
    return joined, (f"{step}.run_id = %s AND {task}.run_id = %s AND {agent}.run_id = %s"
                    f" AND {agent}.attempt_number = %s")


@per_vendor
def _tree_sql() -> str:
    """The current attempt's nodes of a run: each table filtered by its own run index (the run's
    rows only, whatever the planner's statistics say: a fresh or just-grown table is never joined
    whole), in the order of the steps (the tree sorts its levels)."""
    nodes, of_run = _nodes_sql("s", "t", "a")
    columns = f"{_tree_columns_sql('s', 't', 'a')}{_versions_sql('s', 't', 'a')}"
    return f"SELECT {columns} FROM {nodes} WHERE {of_run} ORDER BY s.id"


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
    ``_current_attempt`` and ``_run_tree`` keep them (read under the run's lock, as those read them).
    With a tree handed over (``run_tree_handed_over``) whose nodes' row versions are all still
    the database's, the statement sends no node and that tree is kept instead."""
    number = run.attempt_number
    handed, expected = _tree_handed(run)
    params = [run.pk, number, run.pk, run.pk, run.pk, run.pk, number, attempt_id]
    with hot_cursor() as cursor:
        if expected is None:
            cursor.execute(_step_attempt_read_sql(False), params)
        else:
            cursor.execute(_step_attempt_read_sql(True), [expected, run.pk, run.pk, run.pk, number, *params])
        rows = cursor.fetchall()
    if expected is not None and rows and rows[0][-1] is False:  # every node as handed over
        return _step_attempt_kept(run, rows, 0, tree=handed)
    return _step_attempt_kept(run, rows, 0, versioned=_versioned())


def _step_attempt_kept(run: Run, rows, at: int, *, versioned: bool = False,
                       tree: RunTree | None = None) -> StepAttempt | None:
    """The step attempt of rows holding its columns from ``at``, then the run's current attempt's,
    whether the run has artifacts without an expiry, and its tree's; the attempt, that answer and
    the tree kept on the run (in a ``run_atomic()`` transaction). ``versioned``: the tree's row
    versions follow its columns; ``tree``: the tree to keep (handed over; the rows hold no node)."""
    if not rows or rows[0][at + _STEP_ATTEMPT_ROWS.names.index("id")] is None:
        return None
    attempt = _STEP_ATTEMPT_ROWS.load(rows[0], at)
    at += _STEP_ATTEMPT_ROWS.width
    scope = run_atomic_scope()
    if scope is not None:
        if rows[0][at + _ATTEMPT_ROWS.names.index("id")] is not None:
            run.__dict__["_attempt"] = (scope, run.attempt_number, _ATTEMPT_ROWS.load(rows[0], at))
        run.__dict__["_open_artifacts"] = (scope, bool(rows[0][at + _ATTEMPT_ROWS.width]))
    if tree is not None:
        _run_tree_adopt(run, tree)
        return attempt
    start = at + _ATTEMPT_ROWS.width + 1
    _run_tree_keep(run, _tree_steps(rows, start, versions_at=start + _TREE_WIDTH if versioned else None))
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
def _step_attempt_read_sql(guarded: bool) -> str:
    """A step attempt, whether a run has artifacts without an expiry, the run's attempt of a number and
    that attempt's tree (``_tree_sql``'s rows, an outer join: one row with none when it has no nodes
    yet), with its row versions on PostgreSQL. ``guarded`` (PostgreSQL): the tree only when its
    nodes' versions (``_versions_text_sql``) are not those given (its first parameters); the last
    column says whether they were not."""
    qn = connection.ops.quote_name
    nodes, of_run = _nodes_sql("s", "t", "g")
    head = (f"SELECT {{m}}, {{a}}, {_open_artifacts_sql('%s')}, {{tree}}"
            f" FROM {qn(StepAttempt._meta.db_table)} m{{f}}"
            f" LEFT JOIN {qn(RunAttempt._meta.db_table)} a ON a.number = %s AND a.run_id = %s")
    columns = f"{_tree_columns_sql('s', 't', 'g')}{_versions_sql('s', 't', 'g')}"
    if not guarded:
        first = "ORDER BY s.id"  # the attempts' columns in the first row only (``_step_attempt_kept`` reads it)
        return (head.format(m=_first_columns(_STEP_ATTEMPT_ROWS, "m", first),
                            a=_first_columns(_ATTEMPT_ROWS, "a", first), tree=columns, f="")
                + f" LEFT JOIN ({nodes}) ON {of_run} WHERE m.id = %s ORDER BY s.id")
    # The nodes in a subquery whose condition holds the versions' answer: when the tree held is
    # current, the join is never run (a one-time filter), rather than run and its rows dropped.
    first = "ORDER BY x.tree_order"
    check = f"WITH f AS MATERIALIZED (SELECT %s::text IS DISTINCT FROM ({_versions_text_sql()}) AS miss) "
    return (check + head.format(m=_first_columns(_STEP_ATTEMPT_ROWS, "m", first),
                                a=_first_columns(_ATTEMPT_ROWS, "a", first), tree="x.*, f.miss", f=" CROSS JOIN f")
            + f" LEFT JOIN (SELECT {columns}, s.id AS tree_order FROM {nodes} WHERE {of_run}"
            " AND (SELECT f.miss FROM f)) x ON true WHERE m.id = %s ORDER BY x.tree_order")


def _versions_text_sql() -> str:
    """PostgreSQL: the row versions of a run's attempt's tree as one text (``_versions_text`` builds
    the same from the nodes held): each step's id and its, its task's and its agent's ``xmin``,
    in the order of the steps; its parameters the run's id three times and the attempt's number."""
    nodes, of_run = _nodes_sql("x", "y", "z")
    return ("SELECT string_agg(x.id::text || ':' || x.xmin::text || ':' || y.xmin::text || ':' || z.xmin::text, ','"
            f" ORDER BY x.id) FROM {nodes} WHERE {of_run}")


# A tree handed from the transaction that left it to the next that reads its run's step attempt:
# the run object of the transaction before (``run_tree_handed_over``), taken by that read.
_handover = threading.local()


@contextmanager
def run_tree_handed_over(previous: Run | None) -> Iterator[dict]:
    """Around the work that follows a committed transaction of a run (its next step's settlement):
    the tree that transaction left on ``previous`` (read under the run's lock, moved and written by
    it) is handed to the first read of a step attempt of that run (``_step_attempt_read``), which
    keeps it rather than reading the nodes again when every node's row version is still the one
    the tree holds: the one read, or that transaction's for a node it wrote (a change by any other
    transaction, committed before the read, gives the row another version); that transaction must
    have committed (``_lock_run_reading`` notes it). Yields what the block saw: ``"rolled_back"``
    once a statement rolled back (to a savepoint, say): the objects it moved may then hold what no
    row holds, and its tree is not to be handed over. A tree whose node holds an unsaved move, or
    no known version, is read again."""
    seen = {"rolled_back": False}

    def watch(execute, sql, params, many, context):
        if isinstance(sql, str) and sql.startswith("ROLLBACK"):
            seen["rolled_back"] = True
        return execute(sql, params, many, context)

    _handover.run = previous
    try:
        with db().execute_wrapper(watch):
            yield seen
    finally:
        _handover.run = None


def _tree_handed(run: Run) -> tuple[RunTree | None, str | None]:
    """The tree handed over for ``run`` (taken: one read uses it) and its nodes' versions as
    ``_versions_text_sql`` gives them; (None, None) when there is none to use."""
    previous = getattr(_handover, "run", None)
    if previous is None:
        return None, None
    _handover.run = None
    tree = previous.__dict__.get("_tree")
    xid = previous.__dict__.get("_xid")
    if (tree is None or xid is None or not previous.__dict__.get("_committed") or previous.pk != run.pk
            or previous.attempt_number != run.attempt_number or tree.attempt_number != run.attempt_number
            or not tree.steps):
        return None, None
    for node in tree.nodes():
        version = node.__dict__.get(ROW_VERSION)
        if version == ROW_WRITTEN:  # written by that transaction: its id is the row's version now
            node.__dict__[ROW_VERSION] = version = xid
        if version is None or row_unsaved_move(node):
            return None, None
    return tree, _versions_text(tree)


def _versions_text(tree: RunTree) -> str:
    return ",".join(f"{step.pk}:{step.__dict__[ROW_VERSION]}:{step.task.__dict__[ROW_VERSION]}:"
                    f"{step.task.agent.__dict__[ROW_VERSION]}" for step in sorted(tree.steps.values(),
                                                                                   key=lambda s: s.pk))


def _run_tree_adopt(run: Run, tree: RunTree) -> None:
    """Keep a handed-over tree on ``run`` (the run just read under its lock) for the rest of the
    ``run_atomic()`` transaction; its nodes' run is this one."""
    scope = run_atomic_scope()
    if scope is None:
        return
    tree.scope = scope
    run.__dict__["_tree"] = tree
    for node in tree.nodes():
        if "run" in node._state.fields_cache:
            node._state.fields_cache["run"] = run


def _run_tree_forget(run: Run) -> None:
    run.__dict__.pop("_tree", None)
