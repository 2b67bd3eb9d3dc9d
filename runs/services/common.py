"""What every run service shares: the run's row lock, the before/after snapshot and its audit and
event records, node moves, the hooks other apps register, and the spawning of a plan's hierarchy.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from django_fsm import can_proceed

from core.errors import (
    InvalidTransition,
    NotFound,
)
from core.models import Project
from core.fsm import save_moved_together
from core.inserts import insert_tree
from core.services import audit_record, row_lock, transition_log
from core.sql import ModelRows, hot_cursor, per_vendor
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
from runs.outbox import run_atomic_scope, run_event_record, run_events_carried
from runs.pipeline import bookkeeping
from runs.services.tree import (
    _AGENT_ROWS,
    _ATTEMPT_ROWS,
    _STEP_ATTEMPT_ROWS,
    _STEP_ROWS,
    _TASK_ROWS,
    _artifacts_open,
    _open_artifacts_sql,
    _run_tree,
    _run_tree_forget,
    _run_tree_keep,
    _step_attempt_kept,
    _step_attempt_read,
    _tree_steps,
)

# Called with the run, locked, in the transaction that moves it where it needs a worker (start,
# resume, retry): the worker's job is queued with the move, so a committed move always has its job
# and a rolled-back one none. The execution engine registers itself here; nothing is called when
# none is registered.
RUN_DISPATCHERS: list[Callable[[Run], None]] = []


# Called after commit with the id of every failed step attempt (diagnosis registers here).
STEP_FAILURE_HOOKS: list[Callable[[int], None]] = []


def _dispatch(run: Run) -> None:
    for dispatcher in RUN_DISPATCHERS:
        dispatcher(run)


def _lock_run(run_id: int) -> Run:
    return row_lock(Run, run_id, entity="run")


def _lock_run_moved(run_id: int, action: str, *, source: str) -> Run | None:
    """The run's row lock and its move by the transition ``action`` from ``source`` in one guarded
    ``UPDATE ... RETURNING`` (built once per vendor), with the fields the service saves with that
    move (``_RUN_MOVES``): the run as it is after. Only a run in ``source`` that is not gated (and
    passes the move's own guard) moves this way, the common case; None otherwise, with nothing
    written: the caller takes the row lock and goes the usual way (no-op, refusal, gated run)."""
    if not connection.features.can_return_columns_from_insert:  # no RETURNING (SQLite before 3.35)
        return None
    target = getattr(Run, action)._django_fsm.get_transition(source).target
    field = Run._meta.get_field("updated_at")
    now = field.get_db_prep_value(timezone.now(), connection)
    with hot_cursor() as cursor:
        cursor.execute(_run_moved_sql(action), [target, now, now, *[now] * _RUN_MOVES[action][1], run_id, source])
        row = cursor.fetchone()
    return None if row is None else _RUN_ROWS.load(row)


# The moves ``_lock_run_moved`` makes: what the service saves with the move (SQL, with so many
# parameters, each the time of the move) and a further guard.
_RUN_MOVES = {
    "start": ("credits_reserved = credits_reserved + credit_limit", 0, " AND deleted_at IS NULL"),
    "mark_running": ("last_heartbeat = %s, started_at = COALESCE(started_at, %s)", 2, " AND status_reason = ''"),
}


@per_vendor
def _run_moved_sql(action: str) -> str:
    qn = connection.ops.quote_name
    also, _, guard = _RUN_MOVES[action]
    columns = ", ".join(qn(field.column) for field in _RUN_ROWS.fields)
    return (f"UPDATE {qn(Run._meta.db_table)} SET status = %s, status_changed_at = %s, updated_at = %s, {also}"
            f" WHERE id = %s AND status = %s AND NOT gated{guard} RETURNING {columns}")


_RUN_ROWS, _PROJECT_ROWS = ModelRows(Run), ModelRows(Project)
_RUN_SAVED = tuple(field.name for field in Run._meta.concrete_fields if not field.primary_key)  # as save writes


@per_vendor
def _lock_run_of_sql(model, reads: str = "") -> str:
    """The run of a ``model`` row, locked, and its project; ``reads`` ``"tree"``: with the current
    attempt's tree (``_tree_sql``'s columns, an outer join), ``"step_attempt"``: with the step attempt
    (the row itself), the run's current attempt and its tree (``_step_attempt_read_sql``'s columns)."""
    qn = connection.ops.quote_name
    lock = " FOR UPDATE OF r" if connection.features.has_select_for_update_of else ""
    columns, joins = [_RUN_ROWS.columns("r"), _PROJECT_ROWS.columns("p")], []
    if reads == "step_attempt":
        columns += [_STEP_ATTEMPT_ROWS.columns("m"), _ATTEMPT_ROWS.columns("a"), _open_artifacts_sql("r.id")]
        joins += [f" LEFT JOIN {qn(StepAttempt._meta.db_table)} m ON m.id = %s AND m.run_id = r.id",
                  f" LEFT JOIN {qn(RunAttempt._meta.db_table)} a ON a.number = r.attempt_number AND a.run_id = r.id"]
    if reads:
        step, task, agent = (qn(node._meta.db_table) for node in (Step, Task, Agent))
        columns += [_STEP_ROWS.columns("s"), _TASK_ROWS.columns("t"), _AGENT_ROWS.columns("g")]
        # Outer joins one after the other, each on an index (the run's steps, then each one's task and
        # agent by id): SQLite read a nested join ``(s JOIN t JOIN g)`` by scanning every run's
        # agents, so a step cost more as the history grew. A step of an earlier attempt comes with
        # no agent, and ``_tree_steps`` passes it over.
        joins.append(f" LEFT JOIN {step} s ON s.run_id = r.id LEFT JOIN {task} t ON t.id = s.task_id"
                     f" AND t.run_id = r.id LEFT JOIN {agent} g ON g.id = t.agent_id AND g.run_id = r.id"
                     " AND g.attempt_number = r.attempt_number")
    if connection.vendor == "postgresql":  # the transaction's id (the lock gives it one): its rows' version
        columns.append("pg_current_xact_id()::xid::text")
    return (f"SELECT {', '.join(columns)} FROM {qn(Run._meta.db_table)} r"
            f" INNER JOIN {qn(Project._meta.db_table)} p ON p.id = r.project_id{''.join(joins)}"
            f" WHERE r.id = (SELECT o.run_id FROM {qn(model._meta.db_table)} o WHERE o.id = %s){lock}")


def _lock_run_of(model, pk: int, *, entity: str, tree: bool = False) -> Run:
    """The run a step or a step attempt belongs to, locked, with its project (read, not locked), in
    one prepared statement (its id read in a subquery); ``NotFound`` when there is no such row.
    ``tree``: the run's tree is kept on it too (``_run_tree``), read in the same statement where the
    transaction holds the database's write lock from its first statement (SQLite's ``BEGIN
    IMMEDIATE``), else after the lock: on PostgreSQL a statement that waited for the row lock would
    read the other rows as they were before it waited."""
    return _lock_run_reading(model, pk, entity=entity, reads="tree" if tree else "")[0]


def _lock_run_of_step_attempt(attempt_id: int) -> tuple[Run, StepAttempt | None]:
    """The run of a step attempt, locked (``_lock_run_of``), and the attempt (None when there is
    none), read with the run's current attempt and tree (``_step_attempt_read``)."""
    return _lock_run_reading(StepAttempt, attempt_id, entity="step attempt", reads="step_attempt")


def _lock_run_reading(model, pk: int, *, entity: str, reads: str) -> tuple[Run, StepAttempt | None]:
    together = reads and connection.vendor == "sqlite"
    with hot_cursor() as cursor:
        cursor.execute(_lock_run_of_sql(model, reads if together else ""),
                       [pk, pk] if together and reads == "step_attempt" else [pk])
        rows = cursor.fetchall()
    if not rows:
        raise NotFound(f"{entity} {pk} does not exist")
    run = _RUN_ROWS.load(rows[0])
    run.project = _PROJECT_ROWS.load(rows[0], _RUN_ROWS.width)
    if not together and connection.vendor == "postgresql":
        # What a tree handed over from this transaction is checked by, once it committed.
        run.__dict__["_xid"] = rows[0][-1]
        transaction.on_commit(lambda: run.__dict__.__setitem__("_committed", True))
    at = _RUN_ROWS.width + _PROJECT_ROWS.width
    if reads == "step_attempt":
        return run, (_step_attempt_kept(run, rows, at) if together else _step_attempt_read(run, pk))
    if reads == "tree":
        if together:
            _run_tree_keep(run, _tree_steps(rows, at))
        else:
            _run_tree(run)
    return run, None


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
                       extra: dict | None = None, audit_after: dict | None = None, created: bool = False,
                       moved: bool = False, with_rows: list | None = None) -> None:
    """Save the run and write its event, audit row and log line (``created``: the run was just
    inserted as it is, with its ``status_changed_at``; ``moved``: it was just moved and saved as it
    is by ``_lock_run_moved``; ``with_rows``: rows to save with it, ``(row, fields)``, in one statement
    on PostgreSQL, ``core.fsm.save_moved_together``)."""
    now = timezone.now()
    if before["status"] != run.status and not created:
        if not moved:
            run.status_changed_at = now
        if run.status in SETTLED_RUN_STATES and _artifacts_open(run):  # settled: its artifacts' time starts
            Artifact.objects.filter(run=run, expires_at__isnull=True).update(
                expires_at=now + timedelta(days=settings.ORCHESTRATOR_ARTIFACT_TTL_DAYS))
    if not created and not moved and with_rows:
        run.updated_at = now  # as save's auto_now
        save_moved_together([*with_rows, (run, _RUN_SAVED)], put_off=True)
    elif not created and not moved:
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
    run_event_record(type=run_event(run.status), organization_id=run.organization_id, project_id=run.project_id,
                     run_id=run.pk, payload=payload)
    if actor is not None:
        audit_record(actor=actor, action=f"run_{action}", target_type="run", target_id=run.pk,
                     organization_id=run.organization_id, run_id=run.pk, reason=reason, before=before,
                     after={**_snapshot(run), **(audit_after or {})})
    transition_log(entity="run", id=run.pk, project=run.project_id, attempt=run.attempt_number,
                   **{"from": before["status"], "to": run.status}, action=action, reason=reason or run.last_error_code)


def _current_attempt(run: Run) -> RunAttempt | None:
    """The run's current attempt, read once per ``run_atomic()`` transaction: the services change
    it through this one object (and save the fields they change)."""
    scope = run_atomic_scope()
    cached = run.__dict__.get("_attempt")
    if cached is not None and scope is not None and cached[0] is scope and cached[1] == run.attempt_number:
        return cached[2]
    with hot_cursor() as cursor:
        cursor.execute(_current_attempt_sql(), [run.pk, run.attempt_number])
        row = cursor.fetchone()
    attempt = _ATTEMPT_ROWS.load(row) if row is not None else None
    if scope is not None and attempt is not None:
        run.__dict__["_attempt"] = (scope, run.attempt_number, attempt)
    return attempt


@per_vendor
def _current_attempt_sql() -> str:
    return (f"SELECT {_ATTEMPT_ROWS.columns('a')} FROM {connection.ops.quote_name(RunAttempt._meta.db_table)} a"
            " WHERE a.run_id = %s AND a.number = %s")


def _close_attempt(run: Run, attempt: RunAttempt | None, *, outcome: str, error_code: str = "",
                   save: bool = True) -> list[tuple[RunAttempt, tuple[str, ...]]]:
    """End the attempt (with the release ``_settle(..., save=False)`` just made, and a charge not saved
    yet, ``_charge(..., save=False)``, in one UPDATE). ``save=False``: not saved yet; returns the row
    to save with the run (``_record_run_change``'s ``with_rows``)."""
    if attempt is None:
        return []
    attempt.outcome = outcome
    attempt.error_code = error_code
    attempt.ended_at = timezone.now()
    if not save:
        return [(attempt, _ATTEMPT_CLOSED)]
    attempt.save(update_fields=list(_ATTEMPT_CLOSED))
    return []


_ATTEMPT_CLOSED = ("outcome", "error_code", "ended_at", "credits_charged", "credits_refunded")


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
    run_event_record(type=node_event(entity, node.status), organization_id=run.organization_id,
                     project_id=run.project_id, run_id=run.pk, payload=payload)


def _node_move(node, action: str, *, run: Run, error: tuple[str, str] | None = None, emit: bool = True,
               save: bool = True) -> None:
    """Move a node by ``action``, save it (``save=False``: the caller saves it, ``_nodes_saved``, before
    anything reads it), write its log line and its event."""
    tree = run.__dict__.get("_tree")
    if tree is not None and not tree.holds(node):
        _run_tree_forget(run)  # another copy of a node moves: the tree is read again when needed
    before = node.status
    getattr(node, action)()
    now = timezone.now()
    if action == "begin":
        node.started_at = node.started_at or now
    if node.status in DONE_NODE_STATES:
        node.finished_at = now
    if error is not None:
        node.last_error_code, node.last_error = error
    if save:
        node.save_moved(node.MOVING_FIELDS)
    if isinstance(node, Task) and run.gated:
        bookkeeping.phase_moved(run, node, action=action)
    entity = type(node).__name__.lower()
    transition_log(entity=entity, id=node.pk, project=run.project_id, run=run.pk, attempt=run.attempt_number,
                   action=action, **{"from": before, "to": node.status}, reason=node.last_error_code if
                   error is not None else "", name=node.name)
    if emit:
        _node_event(node, before=before, run=run)


def _nodes_saved(nodes: list, *, insert=None) -> None:
    """Save nodes moved by ``_node_move(..., save=False)`` (of different levels) together, with a new
    row ``insert`` (``core.fsm.save_moved_together``); on PostgreSQL the batch's events so far are
    written by the same statement."""
    carry = run_events_carried() if insert is not None and connection.vendor == "postgresql" else None
    save_moved_together([(node, node.MOVING_FIELDS) for node in nodes], insert=insert, carry=carry)


def _nodes_move(nodes, action: str, *, run: Run, values: dict[str, Any] | None = None) -> None:
    """``_node_move`` (without events) of many nodes of one level in one UPDATE: each node's
    transition is checked by its state machine first, then the rows are written together (the
    run's lock keeps out every other writer of its nodes). ``values``: other fields, the same for
    every node, set on the objects and written with them."""
    nodes = list(nodes)
    if not nodes:
        return
    tree = run.__dict__.get("_tree")
    if tree is not None and not all(tree.holds(node) for node in nodes):
        _run_tree_forget(run)
    now = timezone.now()
    moves = []
    for node in nodes:
        before = node.status
        getattr(node, action)()
        if node.status in DONE_NODE_STATES:
            node.finished_at = now
        for name, value in (values or {}).items():
            setattr(node, name, value)
        moves.append((node, before))
    updates = {"status": nodes[0].status, **(values or {})}  # one transition, one target state
    if nodes[0].status in DONE_NODE_STATES or action == "reset":
        updates["finished_at"] = nodes[0].finished_at
    type(nodes[0]).objects.filter(pk__in=[node.pk for node in nodes]).update(**updates)
    for node, before in moves:
        node._update_initial_state()  # saved: a later save of this object expects the new state
        if isinstance(node, Task) and run.gated:
            bookkeeping.phase_moved(run, node, action=action)
        transition_log(entity=type(node).__name__.lower(), id=node.pk, project=run.project_id, run=run.pk,
                       attempt=run.attempt_number, action=action, **{"from": before, "to": node.status}, reason="",
                       name=node.name)


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
        _nodes_move(model.objects.filter(**filters), "cancel", run=run)
    _discard_open_attempts(run, Step.objects.filter(run=run, task__agent__attempt_number=attempt_number))


def _spawn_hierarchy(run: Run) -> int:
    """Create the agents, tasks and steps of the current attempt from the plan (once: a run
    enters running from pending once per attempt, and the names are unique per attempt)."""
    return _spawn_agents(run, run.plan["agents"], keep_tree=True)


def _spawn_agents(run: Run, agent_specs: list[dict], *, first_sequence: int = 0, keep_tree: bool = False) -> int:
    """The agents, their tasks and their steps in one statement (``insert_tree``; one INSERT per level
    where a statement cannot insert into several tables). ``keep_tree``: they
    are the whole tree of the attempt, kept as the run's tree for the rest of the transaction."""
    _run_tree_forget(run)
    agents = [
        Agent(run=run, attempt_number=run.attempt_number, name=agent_spec["name"], sequence=a_seq,
              failure_mode=agent_spec.get("failure_mode", FailureMode.FAIL_FAST),
              parallelism_mode=agent_spec.get("parallelism_mode", ParallelismMode.SEQUENTIAL))
        for a_seq, agent_spec in enumerate(agent_specs, start=first_sequence)
    ]
    specs = [(agent, task_spec) for agent, agent_spec in zip(agents, agent_specs) for task_spec in agent_spec["tasks"]]
    tasks = [
        Task(run=run, agent=agent, name=task_spec["name"], sequence=t_seq,
             failure_mode=task_spec.get("failure_mode", FailureMode.FAIL_FAST),
             parallelism_mode=task_spec.get("parallelism_mode", ParallelismMode.SEQUENTIAL),
             depends_on=list(task_spec.get("depends_on") or []))
        for agent, agent_spec in zip(agents, agent_specs) for t_seq, task_spec in enumerate(agent_spec["tasks"])
    ]
    steps = [
        Step(run=run, task=task, name=step_spec["name"], sequence=s_seq,
             kind=step_spec.get("kind", Step.Kind.TOOL), tool=step_spec.get("tool", ""),
             args={**step_spec.get("args", {}),
                   **({"check": step_spec["check"]} if "check" in step_spec else {}),
                   **({"gate": step_spec["gate"]} if "gate" in step_spec else {})},
             max_tries=MAX_RETRIES_PER_LEVEL if step_spec.get("kind", "tool") == "tool" else 1)
        for task, (_, task_spec) in zip(tasks, specs) for s_seq, step_spec in enumerate(task_spec["steps"])
    ]
    insert_tree([(agents, None), (tasks, "agent"), (steps, "task")])
    if keep_tree and all(step.pk is not None for step in steps):
        _run_tree_keep(run, steps)
    return len(agents)
