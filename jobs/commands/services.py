"""``command_execute``: the one path by which a side effect reaches an ``ExecutionAdapter``.

Guarantees (seed 000, AG-EXE-01):

* the command is recorded — kind, idempotency key, payload hash, ``recorded`` — and
  **committed** before the adapter (or the tool) is called, so it must not be called inside a
  transaction (a durable block enforces it);
* a replay with the same key and payload returns the recorded result (or the recorded final
  failure) without calling anything;
* a command recorded but never finished (its worker died, or a retryable error) is executed
  again with the same key: the adapter is idempotent by key, so the effect happens once;
* the same key with another payload raises ``CommandConflict`` (409 ``command_conflict``);
* every recorded command writes ``command_recorded`` then ``command_succeeded`` or
  ``command_failed`` events (``final`` says whether a failed command may be replayed);
* a ``billed`` command (a ``command`` job's) is charged its tool's cost, once: the first
  execution writes a direct ``charge`` entry keyed ``command:<command id>`` in the transaction
  that records it; without the credits nothing is recorded or called (``InsufficientCredits``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from billing.services import account_charge
from core.errors import ValidationFailed
from core.models import Project
from core.services import actor_label, audit_record, event_record, transition_log
from core.sql import ModelRows, hot_cursor, insert_returning, per_vendor
from core.timefmt import isoformat_or_none
from jobs.commands.adapters import AdapterError, ExecutionAdapter, adapter_get
from jobs.commands.validation import command_args_validate, idempotency_key_errors, payload_hash
from jobs.errors import CommandConflict, CommandFailed
from jobs.events import COMMAND_FAILED, COMMAND_RECORDED, COMMAND_SUCCEEDED
from jobs.models import CommandKind, CommandRecord, CommandStatus
from jobs.registry import JobCancelled, JobTimeout, classify_default
from jobs.tools import ToolCancelled, ToolContext, classify_exception, tool_get

logger = logging.getLogger("orchestrator.commands")

# Interruptions of the worker, not outcomes of the command: the record stays ``recorded``.
INTERRUPTIONS = (JobTimeout, JobCancelled)


@dataclass(frozen=True)
class RecordedCommand:
    """A command recorded by ``command_record`` in a caller's transaction (``execute``: it must
    run now; False: answer from the record). Handed to ``command_execute`` once committed."""

    record: CommandRecord
    execute: bool
    args: dict
    project: Project


@dataclass(frozen=True)
class CommandResult:
    command: CommandRecord
    result: Any
    replayed: bool  # True: answered from the record, nothing was called


def command_as_dict(record: CommandRecord) -> dict[str, Any]:
    """A command in event and API form (without its result)."""
    return {
        "commandId": record.pk,
        "projectId": record.project_id,
        "kind": record.kind,
        "idempotencyKey": record.idempotency_key,
        "payloadHash": record.payload_hash,
        "status": record.status,
        "attempts": record.attempts,
        "errorCode": record.error_code or None,
        "error": record.error or None,
        "createdAt": isoformat_or_none(record.created_at),
        "completedAt": isoformat_or_none(record.completed_at),
    }


def _emit(record: CommandRecord, event_type: str, organization_id: int, extra: dict | None = None,
          emit: Callable[..., Any] | None = None) -> None:
    payload = command_as_dict(record)
    payload.update(extra or {})
    (emit or event_record)(type=event_type, organization_id=organization_id, project_id=record.project_id,
                           payload=payload)


def _locked(project: Project, kind: str, key: str) -> CommandRecord | None:
    return (CommandRecord.objects.select_for_update()
            .filter(project=project, kind=kind, idempotency_key=key).first())


def command_execute(*, project: Project, kind: str, args: dict, idempotency_key: str, actor=None,
                    adapter: ExecutionAdapter | None = None,
                    should_stop: Callable[[], bool] | None = None, attempt: int | None = None,
                    billed: bool = False, on_success: Callable[[CommandResult], Any] | None = None,
                    recorded: RecordedCommand | None = None, emit: Callable[..., Any] | None = None) -> CommandResult:
    """Execute command ``kind`` at most once per ``(project, kind, idempotency_key)``.

    Raises ``ValidationFailed`` (nothing recorded), ``CommandConflict`` (same key, other
    payload), ``CommandFailed`` (the adapter or tool failed; ``retryable`` tells whether a
    replay will try again). ``should_stop`` is handed to tools as their cancellation check;
    ``attempt`` is the caller's own attempt number a tool sees (default: the record's calls).
    ``billed``: charge the command's cost to the project's organization before it first runs
    (``InsufficientCredits``: nothing recorded, nothing called); a step's commands are not
    billed here, the run's reservation pays for them.
    ``on_success`` is called with the result in the transaction that records the success (the
    caller's own outcome commits with it, or neither does and a replay runs again by key); not
    called for a replay answered from the record.
    ``recorded``: the command as ``command_record`` recorded it in a transaction of the caller's,
    already committed (the same project, kind, key and arguments); it is not recorded again.
    ``emit`` (with ``on_success``): where the ``command_succeeded`` event goes, just before
    ``on_success`` is called in the same transaction (a caller batching its events writes it there).
    """
    if recorded is not None:
        record, execute, normalized = recorded.record, recorded.execute, recorded.args
    else:
        key_errors = idempotency_key_errors(idempotency_key)
        if key_errors:
            raise ValidationFailed("invalid command", errors={"idempotency_key": key_errors})
        normalized = command_args_validate(kind, args)
        digest = payload_hash(normalized)
        record, execute = _command_record(project=project, kind=kind, key=idempotency_key, args=normalized,
                                          digest=digest, actor=actor, billed=billed)
    if not execute:
        return _replayed(record)
    try:
        if kind == CommandKind.INVOKE_TOOL:
            result = _tool_invoke(normalized, key=idempotency_key, attempt=attempt or record.attempts,
                                  should_stop=should_stop, project_id=project.pk)
        else:
            operation = getattr(adapter or adapter_get(), kind)
            result = operation(project_id=project.pk, idempotency_key=idempotency_key, **normalized)
    except INTERRUPTIONS:
        raise
    except Exception as exc:
        retryable, code, message = _classify(kind, exc)
        record = _command_fail(record_id=record.pk, organization_id=project.organization_id, code=code,
                               message=message, final=not retryable)
        if record.status == CommandStatus.SUCCEEDED:  # a concurrent replay finished it meanwhile
            return CommandResult(record, record.result, replayed=True)
        raise CommandFailed(message, reason=code, retryable=retryable, command_id=record.pk) from exc
    record = _command_succeed(record_id=record.pk, organization_id=project.organization_id, result=_jsonable(result),
                              on_success=on_success, emit=emit if on_success is not None else None)
    return CommandResult(record, record.result, replayed=False)


def _replayed(record: CommandRecord) -> CommandResult:
    if record.status == CommandStatus.SUCCEEDED:
        return CommandResult(record, record.result, replayed=True)
    raise CommandFailed(record.error or "the command failed", reason=record.error_code or "command_failed",
                        retryable=False, command_id=record.pk)


def command_cost(kind: str, args: dict) -> int:
    """Credits a billed command costs: its tool's registered cost; adapter commands are free."""
    if kind != CommandKind.INVOKE_TOOL:
        return 0
    tool = tool_get(args.get("tool")) if isinstance(args.get("tool"), str) else None
    return tool.cost if tool is not None else 0


def _command_charge(record: CommandRecord, project: Project, actor) -> None:
    """Charge a billed command once (its ledger key is the command's id); may refuse."""
    cost = command_cost(record.kind, record.args)
    if cost <= 0:
        return
    account_charge(organization_id=project.organization_id, project_id=project.pk, amount=cost,
                   idempotency_key=f"command:{record.pk}", actor=actor,
                   reason=f"{record.kind} {record.args.get('tool')} (key {record.idempotency_key})"[:500])


def command_record(*, project: Project, kind: str, args: dict, idempotency_key: str, actor=None,
                   new: bool = False, emit: Callable[..., Any] | None = None) -> RecordedCommand:
    """Record (or find) command ``kind`` in the caller's transaction, which must commit before
    ``command_execute(..., recorded=...)`` runs it: the record is committed with the change that
    calls for it (a step attempt's begin records its tool call), in one transaction.

    ``new``: the caller knows no command has this key yet (it was made in this very
    transaction, e.g. from a step attempt's new unique key): no lookup before the insert, no
    savepoint. ``emit`` writes the ``command_recorded`` event (default ``event_record``: a caller
    batching its transaction's events passes its own). Raises ``ValidationFailed`` and
    ``CommandConflict`` as ``command_execute`` does.
    """
    key_errors = idempotency_key_errors(idempotency_key)
    if key_errors:
        raise ValidationFailed("invalid command", errors={"idempotency_key": key_errors})
    normalized = command_args_validate(kind, args)
    record, execute = _command_record_in(project=project, kind=kind, key=idempotency_key, args=normalized,
                                         digest=payload_hash(normalized), actor=actor, new=new, emit=emit)
    return RecordedCommand(record, execute, normalized, project)


def _command_record(*, project: Project, kind: str, key: str, args: dict, digest: str,
                    actor, billed: bool = False) -> tuple[CommandRecord, bool]:
    """Record (or find) the command, charge it when ``billed``, and commit; True when it must
    be executed now."""
    with transaction.atomic(durable=True):
        return _command_record_in(project=project, kind=kind, key=key, args=args, digest=digest, actor=actor,
                                  billed=billed)


def _command_record_in(*, project: Project, kind: str, key: str, args: dict, digest: str, actor,
                       billed: bool = False, new: bool = False,
                       emit: Callable[..., Any] | None = None) -> tuple[CommandRecord, bool]:
    """``_command_record`` in the caller's transaction."""
    record = None if new else _locked(project, kind, key)
    created = False
    if new:  # one prepared INSERT (a step attempt's begin records its tool call)
        record = CommandRecord(project=project, kind=kind, idempotency_key=key, payload_hash=digest, args=args,
                               actor_label=actor_label(actor), attempts=1)
        insert_returning(record)
        created = True
    elif record is None:
        try:
            with transaction.atomic():
                record = CommandRecord.objects.create(
                    project=project, kind=kind, idempotency_key=key, payload_hash=digest, args=args,
                    actor_label=actor_label(actor))
            created = True
        except IntegrityError:
            record = _locked(project, kind, key)  # a concurrent recorder committed it first
            if record is None:
                raise
    if record.payload_hash != digest:
        logger.warning("command conflict: %s %r recorded with hash %s, replayed with %s", kind, key,
                       record.payload_hash, digest)
        raise CommandConflict(
            f"idempotency key {key!r} of command {kind} was recorded with another payload",
            kind=kind, idempotency_key=key, command_id=record.pk)
    if record.status != CommandStatus.RECORDED:
        return record, False
    if billed:
        _command_charge(record, project, actor)  # InsufficientCredits rolls the record back
    if not new:  # a new record was inserted with its first call counted
        record.attempts += 1
        record.save(update_fields=["attempts", "updated_at"])
    if created:
        _emit(record, COMMAND_RECORDED, project.organization_id, emit=emit)
        if actor is not None:
            audit_record(actor=actor, action="command_execute", target_type="command", target_id=record.pk,
                         organization_id=project.organization_id,
                         after={"kind": kind, "idempotencyKey": key, "payloadHash": digest})
    transition_log(entity="command", id=record.pk, project=project.pk, kind=kind, attempt=record.attempts,
                   **{"from": "new" if created else record.status, "to": record.status})
    return record, True


_RECORD_ROWS = ModelRows(CommandRecord)


def _command_succeed(*, record_id: int, organization_id: int, result: Any,
                     on_success: Callable[[CommandResult], Any] | None = None,
                     emit: Callable[..., Any] | None = None) -> CommandRecord:
    with transaction.atomic(durable=True):
        record = _recorded_succeed(record_id, result)  # the usual case, one statement: recorded → succeeded
        before = CommandStatus.RECORDED
        if record is None:
            record = _RECORD_ROWS.by_pk(record_id, lock=True)
            if record is None:
                raise CommandRecord.DoesNotExist(f"command {record_id} does not exist")
            if record.status == CommandStatus.SUCCEEDED:
                if on_success is not None:
                    on_success(CommandResult(record, record.result, replayed=True))
                return record  # a concurrent replay stored its result first; the first result stands
            before = record.status
            record.status = CommandStatus.SUCCEEDED
            record.result = result
            record.error = ""
            record.error_code = ""
            record.completed_at = timezone.now()
            record.save(update_fields=["status", "result", "error", "error_code", "completed_at", "updated_at"])
        _emit(record, COMMAND_SUCCEEDED, organization_id, emit=emit)
        transition_log(entity="command", id=record.pk, project=record.project_id, kind=record.kind,
                       attempt=record.attempts, **{"from": before, "to": record.status})
        if on_success is not None:
            on_success(CommandResult(record, record.result, replayed=False))
        return record


def _recorded_succeed(record_id: int, result: Any) -> CommandRecord | None:
    """The record ``record_id`` moved from recorded to succeeded with ``result`` (locked by its
    update), as it is after the move; None when it is not recorded (gone, or finished meanwhile)."""
    now = timezone.now()
    result_field = CommandRecord._meta.get_field("result")
    with hot_cursor() as cursor:
        cursor.execute(_recorded_succeed_sql(), [CommandStatus.SUCCEEDED, result_field.get_db_prep_save(result, connection),
                                                 now, now, record_id, CommandStatus.RECORDED])
        row = cursor.fetchone()
    return None if row is None else _RECORD_ROWS.load(row)


@per_vendor
def _recorded_succeed_sql() -> str:
    qn = connection.ops.quote_name
    return (f"UPDATE {qn(CommandRecord._meta.db_table)} SET status = %s, result = %s, error = '', error_code = '',"
            f" completed_at = %s, updated_at = %s WHERE id = %s AND status = %s"
            f" RETURNING {', '.join(qn(field.column) for field in _RECORD_ROWS.fields)}")


def _command_fail(*, record_id: int, organization_id: int, code: str, message: str, final: bool) -> CommandRecord:
    with transaction.atomic(durable=True):
        record = CommandRecord.objects.select_for_update().get(pk=record_id)
        if record.status == CommandStatus.SUCCEEDED:
            return record
        before = record.status
        record.error = message
        record.error_code = code[:64]
        if final:
            record.status = CommandStatus.FAILED
            record.completed_at = timezone.now()
        record.save()
        _emit(record, COMMAND_FAILED, organization_id, {"final": final, "retryable": not final})
        transition_log(entity="command", id=record.pk, project=record.project_id, kind=record.kind,
                       attempt=record.attempts, **{"from": before, "to": record.status}, reason=code)
        return record


def _classify(kind: str, exc: BaseException) -> tuple[bool, str, str]:
    """``(retryable, code, message)`` of an adapter or tool exception."""
    if isinstance(exc, AdapterError):
        return exc.retryable, exc.code, str(exc)
    if kind == CommandKind.INVOKE_TOOL:
        return classify_exception(exc)
    retryable = classify_default(exc) == "retryable"
    return retryable, "retryable_error" if retryable else "fatal_error", f"{type(exc).__name__}: {exc}"


def _tool_invoke(args: dict, *, key: str, attempt: int, should_stop: Callable[[], bool] | None,
                 project_id: int | None = None) -> Any:
    """Run a registered tool with the command's idempotency key (the tool must honour it)."""
    tool = tool_get(args["tool"])
    if tool is None:
        raise AdapterError(f"tool {args['tool']!r} is not registered", code="unknown_tool")
    context = ToolContext(idempotency_key=key, attempt=attempt, should_stop=should_stop or (lambda: False),
                          project_id=project_id)
    try:
        return tool.func(args["args"], context)
    except ToolCancelled as exc:
        raise JobCancelled(str(exc)) from exc


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return {"repr": repr(value)}
