"""The ``command`` job type: one command run standalone in its project's lane.

Payloads::

    {"command": "create_deployment", "args": {"name": "web"}, "idempotency_key": "deploy-web-1"}
    {"tool": "echo", "args": {"text": "hi"}}                       # key: job:<job id>

A ``command`` payload needs its own idempotency key. A ``tool`` payload may omit it: the key is
then ``job:<job id>``, the same for every attempt of the job, so a retried or recovered job
replays its command instead of repeating the side effect. Conflicts and invalid arguments
are fatal; adapter and tool failures keep their own retryable/fatal classification.

A tool run this way is billed like a step: its registered cost is charged to the project's
organization once per command, when the command is first executed (a replay or a retry of the
same command is not charged again). An organization that cannot pay gets ``402
insufficient_credits`` from the API when that is already known at enqueue time, and in any
case the job fails with reason ``insufficient_credits`` before anything is recorded or run.
"""

from __future__ import annotations

from typing import Any

from billing.errors import InsufficientCredits
from billing.selectors import account_balance, direct_charge_exists
from core.errors import ValidationFailed
from core.models import Project
from jobs.commands.services import command_cost, command_execute
from jobs.commands.validation import WRITE_COMMANDS, command_args_validate, idempotency_key_errors
from jobs.errors import CommandConflict
from jobs.models import CommandKind, CommandRecord, CommandStatus
from jobs.registry import Dedupe, JobDefinition, RetryPolicy, classify_default, register

JOB_TYPE = "command"
PAYLOAD_FIELDS = frozenset({"command", "tool", "args", "idempotency_key"})


def _command_of(payload: dict) -> tuple[str, dict]:
    """``(kind, args)`` of a payload (a ``tool`` payload is an ``invoke_tool`` command)."""
    if "tool" in payload:
        return CommandKind.INVOKE_TOOL, {"tool": payload["tool"], "args": payload.get("args", {})}
    return payload["command"], payload.get("args", {})


def command_job_validate(payload: dict) -> dict:
    """Check a ``command`` job payload; field errors are keyed ``payload.<field>``."""
    errors: dict[str, list[str]] = {}
    for name in sorted(set(payload) - PAYLOAD_FIELDS):
        errors[f"payload.{name}"] = ["unknown field"]
    if ("command" in payload) == ("tool" in payload):
        errors["payload"] = ["give exactly one of command or tool"]
    elif "command" in payload and payload["command"] not in WRITE_COMMANDS:
        errors["payload.command"] = [f"{payload['command']!r} is not a command; one of "
                                     f"{', '.join(sorted(WRITE_COMMANDS))}"]
    elif "tool" in payload and not isinstance(payload["tool"], str):
        errors["payload.tool"] = ["a tool name"]
    if "command" in payload or "idempotency_key" in payload:
        key_errors = idempotency_key_errors(payload.get("idempotency_key"))
        if key_errors:
            errors["payload.idempotency_key"] = key_errors
    if not errors:
        kind, args = _command_of(payload)
        try:
            command_args_validate(kind, args)
        except ValidationFailed as exc:
            for field, messages in exc.errors.items():
                if kind == CommandKind.INVOKE_TOOL and "command" not in payload:
                    field = {"args.tool": "tool", "args.args": "args"}.get(field, field)
                errors[f"payload.{field}"] = messages
    if errors:
        raise ValidationFailed("invalid command job payload", errors=errors)
    return payload


def command_job_run(ctx, payload: dict) -> dict[str, Any]:
    kind, args = _command_of(payload)
    key = payload.get("idempotency_key") or f"job:{ctx.job_id}"
    project = Project.objects.get(pk=ctx.project_id)
    outcome = command_execute(project=project, kind=kind, args=args, idempotency_key=key,
                              should_stop=ctx.should_stop, billed=True)
    return {"command": kind, "commandId": outcome.command.pk, "idempotencyKey": key, "replayed": outcome.replayed,
            "result": outcome.result}


def command_job_credits_check(*, project: Project, payload: dict) -> None:
    """Refuse now (``InsufficientCredits``) a command job its organization cannot pay for.

    Only a pre-check at enqueue time: the charge itself happens, exactly once, when the command
    first runs. A command already finished or already charged under the payload's key is a
    replay and costs nothing.
    """
    kind, args = _command_of(payload)
    cost = command_cost(kind, args)
    if cost <= 0:
        return
    key = payload.get("idempotency_key")
    if key:
        record = (CommandRecord.objects.filter(project=project, kind=kind, idempotency_key=key)
                  .values("pk", "status").first())
        if record is not None and (record["status"] != CommandStatus.RECORDED or direct_charge_exists(
                organization_id=project.organization_id, idempotency_key=f"command:{record['pk']}")):
            return
    available = account_balance(organization_id=project.organization_id)["available"]
    if available < cost:
        raise InsufficientCredits(
            f"organization {project.organization_id} has {available} credits available; {cost} needed",
            available=available, required=cost,
        )


def classify_command_error(exc: BaseException) -> str:
    """Conflicts and invalid arguments never heal by retrying."""
    if isinstance(exc, (CommandConflict, ValidationFailed)):
        return "fatal"
    return classify_default(exc)


COMMAND = register(JobDefinition(
    type=JOB_TYPE, run=command_job_run, validate=command_job_validate, priority_class="background",
    lane="project",
    dedupe=Dedupe("none"), retry=RetryPolicy(max_attempts=3, classify=classify_command_error),
))
