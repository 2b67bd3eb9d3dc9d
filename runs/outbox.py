"""The run engine's events, written in one statement per transaction.

A run service that moves many things at once (a step settles, its task, agent and run follow, the
ledger records the charge and the release) writes its events through ``run_event_record`` inside
``run_events_batch()``: the rows are kept in order and written with one
``core.services.events_record`` INSERT when the block ends (inside the service's transaction, so
they commit or roll back with it, and their ids increase in the order they were recorded).

Outside a batch ``run_event_record`` writes at once (``core.services.event_record``). ``run_atomic()``
opens a transaction (a savepoint when nested) with a batch inside: a nested one first writes the
outer batch's rows (before its savepoint, so a rollback of the savepoint cannot take them), and
drops its own rows when an exception leaves it (the savepoint rolled back what they describe).
Code that lets another app write events inside a batch (the queue's enqueue, a command record)
calls ``run_events_flush()`` first, so the ids stay in the order of the changes they describe.

A write that needs a lock many transactions share (the organization's credit account, for a step's
charge) can be put off to the batch's end with ``run_deferred(write)``: it runs just
before the rows are written (or before ``run_deferred_flush()``: another write of that account in
the transaction first, or ``run_deferred_take()``: the caller makes them with a write of its own),
so the shared lock is held for the end of the transaction only; its event keeps the place it was
asked for in the batch (a slot the write fills).

Inside ``run_atomic()`` on PostgreSQL the nodes' and the run's moves wait for the next statement
(``core.fsm.moves_put_off``): a cascade's moves (the step, its task, its agent, the run and its
attempt) are written together, with the next step's begin or with the batch's events.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

from django.db import transaction

from core.fsm import moves_put_off
from core.services import event_record, events_record, events_statement

_state = threading.local()


def _pending() -> list[dict[str, Any]] | None:
    return getattr(_state, "rows", None)


def run_atomic_scope() -> object | None:
    """A token for the current outermost ``run_atomic()`` block (None outside one); it changes when
    a nested block rolls back. What a service reads once per transaction is kept under it."""
    return getattr(_state, "scope", None)


def run_event_record(*, type: str, organization_id: int | None, project_id: int | None = None,
                     run_id: int | None = None, payload: dict[str, Any] | None = None) -> None:
    """Record one event: kept for the batch's INSERT inside a batch, written at once outside one."""
    rows = _pending()
    row = {"type": type, "organization_id": organization_id, "project_id": project_id, "run_id": run_id,
           "payload": payload or {}}
    if rows is None:
        event_record(**row)
    else:
        rows.append(row)


def run_deferred(write) -> None:
    """Call ``write`` at the batch's end, before its rows are written (at once outside a batch), with
    an event sink (``run_event_record``'s keywords) whose one event takes the place in the batch it
    had when this was asked."""
    rows = _pending()
    if rows is None:
        write(run_event_record)
        return
    slot: dict[str, Any] = {}
    rows.append(slot)
    rows.append(_PutOff(write, lambda **row: slot.update(row, payload=row.get("payload") or {})))


class _PutOff:
    """A put-off write and the event sink of its slot; called, it makes the write."""

    def __init__(self, write, sink) -> None:
        self.write, self.sink = write, sink

    def __call__(self) -> None:
        self.write(self.sink)


def run_deferred_take() -> list[tuple[Any, Any]]:
    """Take the batch's put-off writes out of it (in order), each with the event sink of its slot:
    for a caller that makes them itself, together with a write of the same rows of its own."""
    rows = _pending()
    if not rows or not any(callable(row) for row in rows):
        return []
    taken = [(row.write, row.sink) for row in rows if callable(row)]
    rows[:] = [row for row in rows if not callable(row)]
    return taken


def run_deferred_flush() -> None:
    """Make the batch's put-off writes now (in order): before a write of the same rows of its own."""
    rows = _pending()
    if rows and any(callable(row) for row in rows):
        writes = [row for row in rows if callable(row)]
        rows[:] = [row for row in rows if not callable(row)]
        for write in writes:
            write()


def run_events_carried() -> tuple[str, list] | None:
    """The batch's rows so far (up to its first put-off write, whose event must come first), taken
    out as a part of a ``WITH`` and its parameters (``core.services.events_statement``), for a write
    of the caller's that records them in its own statement (PostgreSQL); None when there are none
    or outside a batch."""
    rows = _pending()
    if not rows:
        return None
    count = 0
    for row in rows:
        if callable(row) or not row:
            break
        count += 1
    if not count:
        return None
    carried = rows[:count]
    del rows[:count]
    return events_statement(carried)


def run_events_flush() -> None:
    """Write the batch's rows now (in order), e.g. before another app writes events of its own;
    its put-off writes first."""
    rows = _pending()
    if rows:
        run_deferred_flush()
        events_record([row for row in rows if row])  # (a put-off write's slot it did not fill: no event)
        rows.clear()


@contextmanager
def run_atomic(*, savepoint: bool = True) -> Iterator[None]:
    """``transaction.atomic()`` whose ``run_event_record`` rows are written in one INSERT at its end
    (also a decorator: ``@run_atomic()``). ``savepoint=False`` inside a transaction: no savepoint,
    for a caller whose transaction fails as a whole when this block fails (as
    ``transaction.atomic(savepoint=False)``); inside a batch its rows join the outer batch."""
    rows = _pending()
    if rows is not None and not savepoint:  # nested without a savepoint: one batch, one fate
        with transaction.atomic(savepoint=False):
            yield
        return
    if rows is not None:  # nested: the outer batch's rows go first, outside the savepoint
        run_events_flush()
        with transaction.atomic(savepoint=savepoint):
            try:
                yield
            except BaseException:
                rows.clear()  # only this block's rows are left: its savepoint is rolled back
                _state.scope = object()  # and what was read under the old token may be stale
                raise
        return
    with transaction.atomic(savepoint=savepoint), moves_put_off():
        _state.rows, _state.scope = [], object()
        try:
            yield
            run_events_flush()
        finally:
            _state.rows = _state.scope = None
