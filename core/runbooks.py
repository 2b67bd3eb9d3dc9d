"""Runbooks (seed 001 §9): one declaration per operator action, shared by the admin and the shell.

A ``Runbook`` declares everything about one operator action: its name and title, the model
its objects are rows of, its permission (codename and label), its confirmation form and
command arguments, the per-object button (and the states it shows on), the management
command's name and description, and two functions: ``plan`` says what the action would do
to one object (the state change, the credits at stake, or why it would be skipped) and
``perform`` calls the service that does it (``transition`` builds the usual one).

Each app registers its runbooks here (``runbook_register`` in its ``AppConfig.ready``); from
the registry come the admin actions and buttons (``core.admin_runbooks``), the management
commands (``core.management.base.runbook_command``), the permissions and their place in the
"Operators" group (``operators_sync``, on ``post_migrate``) and the entries diagnosis suggests.

``runbook_execute`` applies a runbook to objects one by one and reports per object: ``done``,
``skipped`` (nothing to do: already in the target state or ended) or ``refused`` (a domain
error, with its code and detail). A refusal of one object never stops the others, and nothing
here writes a row itself: every change, with its audit record, is made by the service
``perform`` calls.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from django import forms
from django.core.exceptions import ImproperlyConfigured, ObjectDoesNotExist
from django.urls import reverse

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


class RunbookForm(forms.Form):
    """The reason every runbook asks for in the admin; a runbook's ``form`` adds its own fields."""

    reason = forms.CharField(widget=forms.Textarea(attrs={"rows": 3, "cols": 80}), max_length=2000,
                             error_messages={"required": "A reason is required."},
                             help_text="Why you do this. Recorded in the audit trail with your name.")

    def clean_reason(self):
        reason = (self.cleaned_data.get("reason") or "").strip()
        if not reason:
            raise forms.ValidationError("A reason is required.")
        return reason

    def runbook_options(self) -> dict:
        """The options for the runbook: every cleaned field except the reason."""
        if self.is_bound:
            data = getattr(self, "cleaned_data", None) or {}
        else:
            data = {name: self.get_initial_for_field(field, name) for name, field in self.fields.items()}
        return {name: value for name, value in data.items() if name != "reason"}


@dataclass(frozen=True)
class Runbook:
    """An operator action, declared once.

    ``plan(target, options)`` → ``Plan``; ``perform(target, actor=, reason=, options=)`` → a one-line
    account of what changed (or raises ``Skip`` / a ``DomainError``).

    The admin offers it as the action ``name`` on ``model``'s list (labelled ``action_label``) with
    ``form`` (its fields are the options; ``initial(objects)`` their first values), and as a button
    on an object's page when ``button`` is set, the object's ``state_field`` is in ``button_states``
    (any state when empty) and the plan applies. ``permission`` (``app.codename``, labelled
    ``permission_label``, on ``permission_model``, by default ``model``) is created and given to the
    Operators group after every migration. The shell has it as ``command``: the ids of its ``noun`` (one
    unless ``many``), or the objects ``targets(options, runbook_options)`` selects; ``arguments(parser)``
    adds its own arguments and ``command_options(options)`` turns them into the runbook's options.
    ``command_example`` shows those arguments in a suggested command line (``--amount {amount}``).
    """

    name: str
    title: str
    permission: str
    plan: Callable[[Any, dict], Plan]
    perform: Callable[..., str]
    reason_required: bool = True
    option_names: tuple[str, ...] = field(default_factory=tuple)
    model: Any = None
    permission_label: str = ""
    permission_model: Any = None
    description: str = ""
    action_label: str = ""
    form: type[RunbookForm] = RunbookForm
    initial: Callable[[list], dict] | None = None
    button: bool = True
    button_states: tuple[str, ...] = ()
    state_field: str = "status"
    command: str = ""
    noun: str = "object"
    many: bool = True
    arguments: Callable[[Any], None] | None = None
    command_options: Callable[[dict], dict] | None = None
    targets: Callable[[dict, dict], list] | None = None
    command_example: str = ""

    @property
    def label(self) -> str:
        """``app_label.model_name.name``: unique among registered runbooks."""
        return f"{self.model._meta.label_lower}.{self.name}" if self.model is not None else self.name

    @property
    def admin_action_label(self) -> str:
        return self.action_label or f"{self.title} selected {self.noun}s…"

    def button_shows_on(self, target: Any) -> bool:
        """Whether the object's page may offer this runbook (its plan must apply as well)."""
        return self.button and (not self.button_states or getattr(target, self.state_field) in self.button_states)

    def admin_url(self, target_id: Any) -> str:
        """The object's button: its confirmation page in the admin."""
        meta = self.model._meta
        return reverse(f"admin:{meta.app_label}_{meta.model_name}_runbook", args=[target_id, self.name])

    def command_line(self, target_id: Any = "", **values: Any) -> str:
        """The command an operator types: ``python manage.py <command> [ID] [arguments] --reason "..."``."""
        parts = ["python manage.py", self.command]
        if self.targets is None:
            parts.append(str(target_id))
        if self.command_example:
            parts.append(self.command_example.format(**values))
        return " ".join([*parts, '--reason "..."'])


# --- the registry -----------------------------------------------------------------------------

RUNBOOKS: dict[str, Runbook] = {}  # label → runbook, in registration order
OPERATORS_GROUP = "Operators"


def runbook_register(runbook: Runbook) -> Runbook:
    """Register ``runbook`` (again: a no-op). A second runbook under the same label or command,
    or one permission declared with two labels, is a configuration error."""
    if runbook.model is None or not runbook.command or not runbook.permission_label:
        raise ImproperlyConfigured(f"runbook {runbook.name!r} needs a model, a command and a permission label")
    known = RUNBOOKS.get(runbook.label)
    if known is runbook:
        return runbook
    if known is not None:
        raise ImproperlyConfigured(f"runbook {runbook.label} is registered twice")
    for other in RUNBOOKS.values():
        if other.command == runbook.command:
            raise ImproperlyConfigured(f"command {runbook.command!r} belongs to runbook {other.label}")
        if other.permission == runbook.permission and other.permission_label != runbook.permission_label:
            raise ImproperlyConfigured(f"permission {runbook.permission!r} has two labels")
    RUNBOOKS[runbook.label] = runbook
    return runbook


def runbooks_for(model: Any) -> list[Runbook]:
    """The runbooks on ``model``'s rows, in registration order."""
    label = model._meta.label_lower
    return [runbook for runbook in RUNBOOKS.values() if runbook.model._meta.label_lower == label]


def runbook_get(model: Any, name: str) -> Runbook:
    """The runbook ``name`` on ``model`` (``KeyError`` when none is registered)."""
    return RUNBOOKS[f"{model._meta.label_lower}.{name}"]


def runbook_for_command(command: str) -> Runbook:
    found = next((runbook for runbook in RUNBOOKS.values() if runbook.command == command), None)
    if found is None:
        raise ImproperlyConfigured(f"no runbook has the command {command!r}")
    return found


def operators_sync(sender=None, *, using: str = "default", **kwargs) -> None:
    """``post_migrate``: every registered runbook's permission exists (with its label) and the
    Operators group holds it. Idempotent; an app's permissions are synced once that app is migrated."""
    from django.contrib.auth.models import Group, Permission
    from django.contrib.contenttypes.models import ContentType

    label = getattr(sender, "label", None)
    wanted = {}
    for runbook in RUNBOOKS.values():
        app_label, codename = runbook.permission.split(".", 1)
        if label is None or app_label == label:
            wanted[(app_label, codename)] = runbook
    if not wanted:
        return
    group, _ = Group.objects.using(using).get_or_create(name=OPERATORS_GROUP)
    for (app_label, codename), runbook in wanted.items():
        meta = (runbook.permission_model or runbook.model)._meta
        if meta.app_label != app_label:
            raise ImproperlyConfigured(f"runbook {runbook.label}: permission {runbook.permission!r} is not of the "
                                       f"app of {meta.label} (set permission_model)")
        content_type = ContentType.objects.db_manager(using).get_for_model(runbook.permission_model or runbook.model)
        permission, created = Permission.objects.using(using).get_or_create(
            content_type=content_type, codename=codename, defaults={"name": runbook.permission_label})
        if not created and permission.name != runbook.permission_label:
            permission.name = runbook.permission_label
            permission.save(update_fields=["name"])
        group.permissions.add(permission)


# --- performing the usual way ----------------------------------------------------------------

def by_id(service: Callable[..., Any], id_argument: str) -> Callable[..., Any]:
    """``service(<id_argument>=target.pk, actor=, reason=)`` as a ``transition`` call."""

    def call(target, *, actor, reason: str, options: dict):
        return service(**{id_argument: target.pk}, actor=actor, reason=reason)

    return call


def transition(call: Callable[..., Any], *, state_field: str = "status",
               then: Callable[[Any, Any], str] | None = None,
               skip: Callable[[Any], str] | None = None) -> Callable[..., str]:
    """A ``perform`` that moves one row by one service: ``call(target, actor=, reason=, options=)``
    returns the row as the service left it. Its ``state_field`` unchanged: ``Skip`` (``skip(row)``
    says why; by default ``already <state>``); changed: ``<before> → <after>`` and ``then(before, after)``."""

    def perform(target, *, actor, reason: str, options: dict) -> str:
        before = copy.copy(target)
        after = call(target, actor=actor, reason=reason, options=options)
        old, new = getattr(before, state_field), getattr(after, state_field)
        if old == new:
            raise Skip(skip(after) if skip else f"already {new}")
        return f"{old} → {new}" + (then(before, after) if then else "")

    return perform


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
