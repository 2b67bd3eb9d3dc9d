"""State moves declared in one line each (django-fsm transitions whose method only moves the field),
and django-fsm's optimistic save check with its state fields looked up once per model.

A model declares ``start = StateMove(status, source=Status.CREATED, target=Status.PENDING)`` where it
would write ``@transition(field=status, source=..., target=...)`` over ``def start(self): pass``: the
class gets that very transition method (``run.start()``, ``can_proceed(run.start)``, the name in
django-fsm's errors and in ``get_available_status_transitions()``). A transition that sets other
fields, or has conditions, keeps the decorator and its body (``Run.retry``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import connection
from django_fsm import ConcurrentTransition, ConcurrentTransitionMixin, FSMFieldMixin, transition

from core.sql import db, hot_cursor, insert_returning, per_vendor

_STATE_FIELDS: dict[type, tuple] = {}


class ConcurrentTransitions(ConcurrentTransitionMixin):
    """``ConcurrentTransitionMixin`` (a save writes the row only while its state fields still hold
    what was read) whose model's state fields are found once per class, not on every instance:
    a run's tree builds dozens of nodes per read, the queue a job per claimed row."""

    @property
    def state_fields(self):
        return _state_fields_of(type(self))

    def save_moved(self, fields: tuple[str, ...]) -> None:
        """``save(update_fields=fields)`` of a row whose state moved, as one prepared ``UPDATE``
        (built once per model and fields): written only while its state fields still hold what
        was read (``ConcurrentTransition`` otherwise, as ``save`` raises). No ``pre_save`` or
        ``post_save`` signal is sent, and ``auto_now`` fields are not touched: for models that
        need neither (the run's nodes)."""
        sql, _ = _moved_update_sql(type(self), fields)
        with hot_cursor() as cursor:
            cursor.execute(sql, _moved_params(self, fields))
            updated = cursor.rowcount
        if updated != 1:
            raise _moved_conflict(self)
        self._update_initial_state()


def save_moved_together(moves: list[tuple[Any, tuple[str, ...]]], *, insert: Any = None) -> None:
    """``save_moved`` of several rows (``(row, fields)``, of any models; a row of a model without state
    fields is written by its primary key alone): on PostgreSQL one prepared statement (each row's
    ``UPDATE`` in a ``WITH``, built once per models and fields), else one each.
    ``ConcurrentTransition`` when a row's state changed since it was read, or it is gone, as
    ``save_moved`` raises (the others may be written: the caller's transaction fails with it).
    ``insert``: a new row inserted with them (``core.sql.insert_returning``; the statement's last
    part on PostgreSQL), which gets its primary key."""
    if db().vendor != "postgresql" or len(moves) + (insert is not None) < 2:
        for row, fields in moves:
            if isinstance(row, ConcurrentTransitions):
                row.save_moved(fields)
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
    for (row, _), count in zip(moves, counts, strict=True):
        if count != 1:
            raise _moved_conflict(row)
    for row, _ in moves:
        if isinstance(row, ConcurrentTransitions):
            row._update_initial_state()


def _moved_params(row, fields: tuple[str, ...]) -> list:
    """The parameters of ``_moved_update_sql``'s statement for ``row``: its fields, its key, the states
    it was read in."""
    _, columns = _moved_update_sql(type(row), fields)
    conn = db()
    params = [field.get_db_prep_save(getattr(row, field.attname), conn) for field in columns]
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
