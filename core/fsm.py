"""State moves declared in one line each (django-fsm transitions whose method only moves the field),
and django-fsm's optimistic save check with its state fields looked up once per model.

A model declares ``start = StateMove(status, source=Status.CREATED, target=Status.PENDING)`` where it
would write ``@transition(field=status, source=..., target=...)`` over ``def start(self): pass``: the
class gets that very transition method (``run.start()``, ``can_proceed(run.start)``, the name in
django-fsm's errors and in ``get_available_status_transitions()``). A transition that sets other
fields, or has conditions, keeps the decorator and its body (``Run.retry``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from django.db import connection
from django_fsm import ConcurrentTransition, ConcurrentTransitionMixin, FSMFieldMixin, transition

from core.sql import (ROW_VERSION, ROW_WRITTEN, WriteMissed, db, db_values, hot_cursor, insert_returning, per_vendor,
                      sqlite_writes)

_STATE_FIELDS: dict[type, tuple] = {}


class ConcurrentTransitions(ConcurrentTransitionMixin):
    """``ConcurrentTransitionMixin`` (a save writes the row only while its state fields still hold
    what was read) whose model's state fields are found once per class, not on every instance:
    a run's tree builds dozens of nodes per read, the queue a job per claimed row."""

    @property
    def state_fields(self):
        return _state_fields_of(type(self))

    def save(self, *args, **kwargs):
        if getattr(_put_off, "rows", None):  # its own statement is built from the states it was read in
            moves_flush()
        super().save(*args, **kwargs)

    def save_moved(self, fields: tuple[str, ...]) -> None:
        """``save(update_fields=fields)`` of a row whose state moved, as one prepared ``UPDATE``
        (built once per model and fields): written only while its state fields still hold what
        was read (``ConcurrentTransition`` otherwise, as ``save`` raises). No ``pre_save`` or
        ``post_save`` signal is sent, and ``auto_now`` fields are not touched: for models that
        need neither (the run's nodes). Inside ``moves_put_off()`` the row is written with the
        next statement instead."""
        if not _put_off_add([(self, fields)]):
            self._save_moved_now(fields)

    def _save_moved_now(self, fields: tuple[str, ...]) -> None:
        sql, _ = _moved_update_sql(type(self), fields)
        with hot_cursor() as cursor:
            cursor.execute(sql, _moved_params(self, fields))
            updated = cursor.rowcount
        moves_written([(self, fields)], [updated])


def save_moved_together(moves: list[tuple[Any, tuple[str, ...]]], *, insert: Any = None,
                        put_off: bool = False, carry: tuple[str, list] | None = None) -> None:
    """``save_moved`` of several rows (``(row, fields)``, of any models; a row of a model without state
    fields is written by its primary key alone) in one statement: on PostgreSQL a prepared one (each
    row's ``UPDATE`` in a ``WITH``, built once per models and fields), on SQLite one through a view
    whose trigger makes the updates (``sqlite_moves_written``).
    ``ConcurrentTransition`` when a row's state changed since it was read, or it is gone, as
    ``save_moved`` raises (the others may be written: the caller's transaction fails with it).
    ``insert``: a new row inserted with them (``core.sql.insert_returning``; the statement's last
    part on PostgreSQL; on SQLite a statement of its own), which gets its primary key. Inside
    ``moves_put_off()`` the rows put off so far are written in the same statement (on SQLite,
    with ``insert``, they all wait for the next statement instead), and ``put_off=True`` (without
    ``insert``) puts these off too. ``carry`` (PostgreSQL, with ``insert``): another part of the
    ``WITH`` (``name AS (...)``, a write of the caller's) and its parameters, written by the same
    statement."""
    if _put_off_rows() is not None:
        if put_off and insert is None:
            _put_off_add(moves)
            return
        if insert is not None and db().vendor != "postgresql":  # the rows wait: no WITH to take them
            _put_off_add(moves)
            with moves_may_wait():  # a new row: it reads none of theirs
                insert_returning(insert)
            return
        moves = _merged(moves_take(), moves)
    _write_together(moves, insert, carry)


def _write_together(moves: list[tuple[Any, tuple[str, ...]]], insert: Any = None,
                    carry: tuple[str, list] | None = None) -> None:
    if not moves and insert is None:
        return
    if carry is not None and insert is not None and db().vendor == "postgresql":
        with_sql, params = moves_statement(moves) if moves else ("WITH", [])
        counts = insert_returning(insert, moves_counts_sql(len(moves)) if moves else "", [*params, *carry[1]],
                                  with_=f"{with_sql}{', ' if moves else ' '}{carry[0]}")
        moves_written(moves, counts or [])
        return
    if db().vendor != "postgresql" and len(moves) > 1:
        sqlite_moves_written(moves, [])
        if insert is not None:
            insert_returning(insert)
        return
    if db().vendor != "postgresql" or len(moves) + (insert is not None) < 2:
        for row, fields in moves:
            if isinstance(row, ConcurrentTransitions):
                row._save_moved_now(fields)
                continue
            sql, _ = _moved_update_sql(type(row), fields)
            with hot_cursor() as cursor:
                cursor.execute(sql, _moved_params(row, fields))
                if cursor.rowcount != 1:
                    raise _moved_conflict(row)
        if insert is not None:
            insert_returning(insert)
        return
    params = [param for row, fields in moves for param in _moved_params(row, fields)]
    shape = tuple((type(row), fields) for row, fields in moves)
    if insert is None:
        with hot_cursor() as cursor:
            cursor.execute(_moved_together_sql(shape), params)
            counts = cursor.fetchone()
    else:
        counts = insert_returning(insert, f"ARRAY[{_moved_counts_sql(len(moves))}]", params,
                                  with_=_moved_with_sql(shape))
    moves_written(moves, counts)


def moves_statement(moves: list[tuple[Any, tuple[str, ...]]]) -> tuple[str, list]:
    """The ``WITH`` that writes ``moves`` (one ``UPDATE`` each, named ``m0``, ``m1``, ...; built once
    per models and fields) and its parameters, for a statement of the caller's own that writes
    them with its own part (and reads their row counts, ``moves_counts_sql``)."""
    shape = tuple((type(row), fields) for row, fields in moves)
    return _moved_with_sql(shape), [param for row, fields in moves for param in _moved_params(row, fields)]


def sqlite_moves_written(moves: list[tuple[Any, tuple[str, ...]]], parts: list[tuple[str, list, bool]]) -> None:
    """On SQLite: write ``moves`` (each one's ``UPDATE``, guarded) and then ``parts`` (writes of the
    caller's, ``core.sql.sqlite_writes``) in one statement; ``ConcurrentTransition`` for a row that
    did not move (nothing of the statement is written then), as ``moves_written`` raises."""
    moved = [(_moved_update_sql(type(row), fields)[0], _moved_params(row, fields), True) for row, fields in moves]
    try:
        sqlite_writes([*moved, *parts])
    except WriteMissed as exc:
        if exc.index < len(moves):
            raise _moved_conflict(moves[exc.index][0]) from exc
        raise
    moves_written(moves, [1] * len(moves))


def moves_counts_sql(count: int) -> str:
    """The row counts of ``moves_statement``'s updates: an SQL array, in the order of the moves."""
    return f"ARRAY[{_moved_counts_sql(count)}]"


def moves_written(moves: list[tuple[Any, tuple[str, ...]]], counts) -> None:
    """After a statement wrote ``moves`` (``counts``: each one's row count): ``ConcurrentTransition``
    for a row that did not move; the rows' states are now the ones written, their version this
    transaction's (``core.sql.ROW_WRITTEN``)."""
    for (row, _), count in zip(moves, counts, strict=True):
        if count != 1:
            raise _moved_conflict(row)
    for row, fields in moves:
        row.__dict__[ROW_VERSION] = ROW_WRITTEN  # its fields as written: this transaction's version
        if isinstance(row, ConcurrentTransitions):  # the states written (a row kept may have moved on since)
            initial = row._ConcurrentTransitionMixin__initial_states
            for field in _state_fields_of(type(row)):
                if field.name in fields or field.attname in fields:
                    initial[field.attname] = getattr(row, field.attname)


def row_unsaved_move(row) -> bool:
    """Whether a state field of ``row`` holds another state than the one it was read or last saved in
    (a move not written yet), or its states are not known."""
    initial = getattr(row, "_ConcurrentTransitionMixin__initial_states", None)
    if initial is None:
        return True
    return any(initial.get(field.attname) != getattr(row, field.attname) for field in _state_fields_of(type(row)))


# Rows whose moves wait for the connection's next statement (``moves_put_off``): a list of
# ``[row, fields]`` in the order they were first put off, or None outside the block.
_put_off = threading.local()


def _put_off_rows() -> list | None:
    return getattr(_put_off, "rows", None)


@contextmanager
def moves_put_off() -> Iterator[None]:
    """Inside, a row's ``save_moved`` (and ``save_moved_together(put_off=True)``) is not written at
    once but kept, and written with the next statement the connection runs: in that statement where
    it knows how (``save_moved_together``, or a caller of ``moves_take``), else in one statement of
    its own just before it (an execute wrapper, so no read or write in between sees the rows as
    they were). Moving a kept row again updates what is kept (one ``UPDATE`` per row, guarded by the states it
    was read in). A ``ROLLBACK TO SAVEPOINT`` drops the kept rows (a savepoint's creation wrote the
    ones before it); leaving the block writes what is left, or drops it when an exception leaves.
    ``ConcurrentTransition`` comes from the statement that writes the row; when that is another
    statement's write and the code around it goes on, leaving the block raises it again (the
    transaction fails as it would have at the move's own write). An object whose kept move a
    rollback dropped cannot be saved again without a fresh read (``ConcurrentTransition``)."""
    conn = db()
    if _put_off_rows() is not None:
        yield
        return
    _put_off.rows, _put_off.failed = [], None
    try:
        with conn.execute_wrapper(_write_kept_first):
            yield
            if _put_off.failed is None and not conn.needs_rollback:
                moves_flush()
            if _put_off.failed is not None:  # a write of kept rows failed under another statement, and
                raise _put_off.failed        # the caller went on: the transaction fails with it all the same
    finally:
        _put_off.rows = _put_off.failed = None


@contextmanager
def moves_may_wait() -> Iterator[None]:
    """Around statements that read and write none of the tables of the rows ``moves_put_off`` keeps
    (the ledger's, say): the kept rows wait for a later statement instead of going before them."""
    before = getattr(_put_off, "waiting", False)
    _put_off.waiting = True
    try:
        yield
    finally:
        _put_off.waiting = before


def moves_flush_of(model: type) -> None:
    """Write the kept rows of ``model`` now (the others stay kept): before statements
    ``moves_may_wait`` lets by that read its table."""
    rows = _put_off_rows()
    if rows and any(type(row) is model for row, _ in rows):
        taken = [(row, fields) for row, fields in rows if type(row) is model]
        rows[:] = [entry for entry in rows if type(entry[0]) is not model]
        _write_kept(taken)


def moves_take() -> list[tuple[Any, tuple[str, ...]]]:
    """The rows kept by ``moves_put_off`` (``(row, fields)``), taken out: the caller writes them now."""
    rows = _put_off_rows()
    if not rows:
        return []
    taken = [(row, fields) for row, fields in rows]
    rows.clear()
    return taken


def moves_flush() -> None:
    """Write the kept rows now (one statement). A failure is kept too: the block fails with it at its
    end even when the code around the statement that caused the write catches it (the write of a
    conflicting move must not pass for that statement's own error)."""
    _write_kept(moves_take())


def _write_kept(moves) -> None:
    try:
        _write_together(moves)
    except BaseException as exc:
        if _put_off_rows() is not None and getattr(_put_off, "failed", None) is None:
            _put_off.failed = exc
        raise


def _put_off_add(moves) -> bool:
    """Keep ``moves`` (False outside ``moves_put_off``), merged with the rows kept (``_merged``)."""
    rows = _put_off_rows()
    if rows is None:
        return False
    rows[:] = _merged(moves_take(), moves)
    return True


def _merged(kept, moves) -> list[tuple[Any, tuple[str, ...]]]:
    """The kept rows then ``moves``, one entry per object (a row moved again gets the fields added);
    before a table row kept through another object than the one in ``moves``, what is merged so far
    is written at once (one statement cannot update a row twice)."""
    merged = [[row, fields] for row, fields in kept]
    for row, fields in moves:
        for entry in merged:
            if entry[0] is row:
                entry[1] = entry[1] + tuple(name for name in fields if name not in entry[1])
                break
            if type(entry[0]) is type(row) and entry[0].pk == row.pk:
                _write_kept([(r, f) for r, f in merged])
                merged = [[row, tuple(fields)]]
                break
        else:
            merged.append([row, tuple(fields)])
    return [(row, fields) for row, fields in merged]


def _write_kept_first(execute, sql, params, many, context):
    """The execute wrapper of ``moves_put_off``: the kept rows go before any other statement (but
    those ``moves_may_wait`` lets by); a savepoint's creation writes them, a rollback to a savepoint
    drops them (kept after it)."""
    rows = _put_off_rows()
    if rows:
        text = sql if isinstance(sql, str) else ""
        if text.startswith("ROLLBACK"):
            for row, _ in rows:  # its move is undone: a later save of this object is refused, as it would
                _stale(row)      # have been had the move been written (the row holds the state before it)
            rows.clear()
        elif text.startswith("SAVEPOINT") or not getattr(_put_off, "waiting", False):
            moves_flush()
    return execute(sql, params, many, context)


# A state no row holds: the initial state of an object whose kept move a rollback dropped.
_NO_STATE = "(rolled back)"


def _stale(row) -> None:
    row.__dict__.pop(ROW_VERSION, None)  # it no longer holds what its version holds
    if isinstance(row, ConcurrentTransitions):
        initial = row._ConcurrentTransitionMixin__initial_states
        for field in _state_fields_of(type(row)):
            initial[field.attname] = _NO_STATE


def _moved_params(row, fields: tuple[str, ...]) -> list:
    """The parameters of ``_moved_update_sql``'s statement for ``row``: its fields, its key, the states
    it was read in."""
    _, columns = _moved_update_sql(type(row), fields)
    conn = db()
    params = db_values(columns, [getattr(row, field.attname) for field in columns], conn)
    initial = getattr(row, "_ConcurrentTransitionMixin__initial_states", {})
    return params + [row.pk, *(initial[field.attname] for field in _state_fields_of(type(row)))]


def _moved_conflict(row) -> ConcurrentTransition:
    return ConcurrentTransition(f"{type(row).__name__} {row.pk}: its state changed since it was read, or it is gone")


class StateMove:
    """A transition of ``field`` from ``source`` (one state or several) to ``target``, nothing else."""

    def __init__(self, field: Any, *, source: str | Sequence[str], target: str) -> None:
        self.field = field
        self.source = list(source) if isinstance(source, list | tuple | set | frozenset) else source
        self.target = target

    def __set_name__(self, owner: type, name: str) -> None:
        def move(instance: Any) -> None:
            pass

        move.__name__ = name
        move.__qualname__ = f"{owner.__qualname__}.{name}"
        setattr(owner, name, transition(field=self.field, source=self.source, target=self.target)(move))


def _state_fields_of(model: type) -> tuple:
    fields = _STATE_FIELDS.get(model)
    if fields is None:
        fields = _STATE_FIELDS[model] = tuple(field for field in model._meta.fields
                                              if isinstance(field, FSMFieldMixin))
    return fields


@per_vendor
def _moved_update_sql(model: type, fields: tuple[str, ...]) -> tuple[str, list]:
    """``save_moved``'s statement for ``model`` and ``fields`` (its state fields guard the row)."""
    qn = connection.ops.quote_name
    meta = model._meta
    columns = [meta.get_field(name) for name in fields]
    sets = ", ".join(f"{qn(field.column)} = %s" for field in columns)
    where = "".join(f" AND {qn(field.column)} = %s" for field in _state_fields_of(model))
    return f"UPDATE {qn(meta.db_table)} SET {sets} WHERE {qn(meta.pk.column)} = %s{where}", columns


@per_vendor
def _moved_together_sql(moves: tuple[tuple[type, tuple[str, ...]], ...]) -> str:
    """``save_moved_together``'s statement: each move's ``UPDATE`` in a ``WITH``, their row counts."""
    return f"{_moved_with_sql(moves)} SELECT {_moved_counts_sql(len(moves))}"


@per_vendor
def _moved_with_sql(moves: tuple[tuple[type, tuple[str, ...]], ...]) -> str:
    updates = [f"m{index} AS ({_moved_update_sql(model, fields)[0]} RETURNING 1)"
               for index, (model, fields) in enumerate(moves)]
    return f"WITH {', '.join(updates)}"


def _moved_counts_sql(count: int) -> str:
    """The row counts of the ``WITH``'s updates, comma-separated."""
    return ", ".join(f"(SELECT count(*) FROM m{index})" for index in range(count))
