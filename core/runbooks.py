"""Runbooks (seed 001 §9): one definition per operator action, shared by the admin and the shell.

A ``Runbook`` names its permission and pairs two functions: ``plan`` says what the action
would do to one object (the state change, the credits at stake, or why it would be skipped)
and ``perform`` calls the service that does it. ``runbook_execute`` applies a runbook to
objects one by one and reports per object: ``done``, ``skipped`` (nothing to do: already in
the target state or ended) or ``refused`` (a domain error, with its code and detail). A
refusal of one object never stops the others, and nothing here writes a row itself: every
change, with its audit record, is made by the service ``perform`` calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from django.core.exceptions import ObjectDoesNotExist

from core.errors import DomainError, ValidationFailed

logger = logging.getLogger("orchestrator.runbooks")

DONE = "done"
SKIPPED = "skipped"
REFUSED = "refused"
PLANNED = "planned"  # a dry run: what would be done


def describe_error(exc: DomainError) -> str:
    """``code: detail (field: messages; ...)`` — one readable line for a domain error."""
    errors = getattr(exc, "errors", None) or {}
    details = "; ".join(f"{name}: {', '.join(messages)}" for name, messages in errors.items())
    return f"{exc.code}: {exc.detail}" + (f" ({details})" if details else "")


class Skip(Exception):
    """Raised by ``perform`` when the service found nothing to do (the object is already there)."""


@dataclass(frozen=True)
class Plan:
    """What a runbook would do to one object: ``skip`` says why it would do nothing, ``refusal``
    why the service is expected to refuse it (it is still asked: it has the last word), and
    ``warning`` anything else the operator should read first."""

    current: str
    change: str
    credits: str = ""
    skip: str = ""
    refusal: str = ""
    warning: str = ""

    @property
    def applies(self) -> bool:
        return not self.skip and not self.refusal


@dataclass(frozen=True)
class Outcome:
    target: Any
    result: str  # done | skipped | refused | planned
    detail: str

    @property
    def label(self) -> str:
        return str(self.target)


@dataclass(frozen=True)
class Runbook:
    """An operator action: ``plan(target, options)`` → ``Plan``; ``perform(target, actor=, reason=,
    options=)`` → a one-line account of what changed (or raises ``Skip`` / a ``DomainError``)."""

    name: str
    title: str
    permission: str
    plan: Callable[[Any, dict], Plan]
    perform: Callable[..., str]
    reason_required: bool = True
    option_names: tuple[str, ...] = field(default_factory=tuple)


def target_refresh(target: Any) -> Any:
    """A fresh copy of a model instance, so a plan is made on current state (other objects as they are).
    Re-read rather than ``refresh_from_db``: protected FSM fields refuse that without ``FSMModelMixin``."""
    meta = getattr(target, "_meta", None)
    if meta is None:
        return target
    return type(target)._default_manager.get(pk=target.pk)


def runbook_plan(runbook: Runbook, target: Any, options: dict | None = None) -> Plan:
    """The plan for one object; a domain error while planning is shown as the expected refusal."""
    try:
        return runbook.plan(target, options or {})
    except DomainError as exc:
        return Plan(current="?", change="?", refusal=describe_error(exc))


def runbook_execute(runbook: Runbook, targets: Iterable[Any], *, actor, reason: str, options: dict | None = None,
                    dry_run: bool = False, on_each: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Apply ``runbook`` to each target in turn and report what happened to each.

    Each object is re-read, planned, and (unless skipped or a dry run) handed to the service;
    a ``DomainError`` refuses that object only (so does an unexpected error, which is logged with
    its traceback). ``reason`` is required when the runbook says so.
    """
    reason = (reason or "").strip()
    if runbook.reason_required and not reason:
        raise ValidationFailed("a reason is required", errors={"reason": ["must not be empty"]})
    options = options or {}
    outcomes: list[Outcome] = []
    for target in targets:
        try:
            target = target_refresh(target)
            plan = runbook.plan(target, options)
            if plan.skip:
                outcome = Outcome(target, SKIPPED, plan.skip)
            elif dry_run:
                detail = plan.change + (f"; {plan.credits}" if plan.credits else "")
                note = plan.refusal and f"expected to be refused: {plan.refusal}" or plan.warning
                outcome = Outcome(target, PLANNED, detail + (f" ({note})" if note else ""))
            else:
                outcome = Outcome(target, DONE, runbook.perform(target, actor=actor, reason=reason, options=options))
        except Skip as exc:
            outcome = Outcome(target, SKIPPED, str(exc))
        except DomainError as exc:
            outcome = Outcome(target, REFUSED, describe_error(exc))
        except ObjectDoesNotExist:
            outcome = Outcome(target, REFUSED, "not_found: it no longer exists")
        except Exception as exc:  # a bug: report it for this object, go on with the others, log the traceback
            logger.exception("runbook %s failed on %r", runbook.name, target)
            outcome = Outcome(target, REFUSED, f"internal_error: {type(exc).__name__}: {exc} (logged)")
        outcomes.append(outcome)
        if on_each is not None:
            on_each(outcome)
    return outcomes
