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

from django_fsm import ConcurrentTransitionMixin, FSMFieldMixin, transition

_STATE_FIELDS: dict[type, tuple] = {}


class ConcurrentTransitions(ConcurrentTransitionMixin):
    """``ConcurrentTransitionMixin`` (a save writes the row only while its state fields still hold
    what was read) whose model's state fields are found once per class, not on every instance:
    a run's tree builds dozens of nodes per read, the queue a job per claimed row."""

    @property
    def state_fields(self):
        cls = type(self)
        fields = _STATE_FIELDS.get(cls)
        if fields is None:
            fields = _STATE_FIELDS[cls] = tuple(field for field in cls._meta.fields
                                                if isinstance(field, FSMFieldMixin))
        return fields


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
