"""Runs, their actions and escalations in the API (snake_case, DESIGN §6)."""

from __future__ import annotations

from types import SimpleNamespace

from django.db import connection
from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from core.api.actors import ActorNames
from core.api.serializers import StrictSerializer, json_without_nul
from core.api.tenancy import MAX_ID
from runs.models import (
    Agent,
    ApprovalRequest,
    DriftRecord,
    EscalationTicket,
    FailureMode,
    GateReceipt,
    NodeStatus,
    Run,
    Step,
    Task,
)

NAME_SCHEMA = {"type": "string", "minLength": 1, "maxLength": 200}
PLAN_SCHEMA = {
    "type": "object",
    "description": "agents → tasks → steps (DESIGN §2.2); validated with field-level errors",
    "required": ["agents"],
    "properties": {
        "max_agents": {"type": "integer", "minimum": 1, "maximum": 100},
        "pins": {"type": "object", "description": "dimension → {provider: file_sha256 | run_field | setting, args}: "
                                                  "recorded when the run begins, re-checked before every check"},
        "caps": {"type": "object", "description": "run_hard_cap_minutes (60), phase_soft_cap_minutes (phase → "
                                                  "minutes), default_phase_soft_cap_minutes"},
        "agents": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "tasks"],
            "properties": {
                "name": NAME_SCHEMA,
                "failure_mode": {"type": "string", "enum": FailureMode.values},
                "parallelism_mode": {"type": "string", "enum": ["sequential", "parallel", "dag"]},
                "tasks": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["name", "steps"],
                    "properties": {
                        "name": NAME_SCHEMA,
                        "failure_mode": {"type": "string", "enum": FailureMode.values},
                        "parallelism_mode": {"type": "string", "enum": ["sequential", "parallel"]},
                        "depends_on": {"type": "array", "items": {"type": "string"}},
                        "soft_cap_minutes": {"type": "number", "description": "this phase's soft cap"},
                        "idempotency_key": {"type": "string", "description": "this phase's key, held by one run "
                                                                             "at a time (released when voided)"},
                        "steps": {"type": "array", "minItems": 1, "items": {
                            "type": "object", "required": ["name"],
                            "properties": {
                                "name": NAME_SCHEMA,
                                "kind": {"type": "string", "enum": Step.Kind.values},
                                "tool": {"type": "string", "description": "echo, sleep, http_request, fail ..."},
                                "args": {"type": "object"},
                                "check": {"type": "string",
                                          "description": "ledger_balanced, file_digest, http_ok, expect ..."},
                                "gate": {"type": "string"},
                                "pins": {"type": "object", "description": "pins a tool step produces"},
                            },
                        }},
                    },
                }},
            },
        }},
    },
}


@extend_schema_field(PLAN_SCHEMA)
class PlanField(serializers.JSONField):
    pass


class RunCreateSerializer(StrictSerializer):
    project = serializers.IntegerField(min_value=1, max_value=MAX_ID)
    name = serializers.CharField(max_length=200)
    plan = PlanField(validators=[json_without_nul])
    priority = serializers.IntegerField(min_value=-1000, max_value=1000, default=100, help_text="lower runs first")
    failure_mode = serializers.ChoiceField(choices=FailureMode.choices, default=FailureMode.FAIL_FAST)
    max_attempts = serializers.IntegerField(min_value=1, max_value=10, default=3)
    credit_limit = serializers.IntegerField(min_value=1, max_value=10**15, required=False, allow_null=True,
                                            help_text="credits reserved per attempt (default: the plan's "
                                                      "worst-case cost)")
    reason = serializers.CharField(max_length=1000, required=False, allow_blank=True, default="")
    mode = serializers.ChoiceField(choices=[("live", "live"), ("dryrun", "dryrun")], default="live",
                                   help_text="dryrun: checks and gates run, tool steps are not executed")


class ActionSerializer(StrictSerializer):
    reason = serializers.CharField(max_length=1000, required=False, allow_blank=True, default="",
                                   help_text="why (kept in the audit trail)")


class RetrySerializer(ActionSerializer):
    plan = PlanField(required=False, validators=[json_without_nul],
                     help_text="an edited plan for the new attempt (validated like a new run's; not for a gated run)")


class ApproveSerializer(ActionSerializer):
    gate = serializers.CharField(max_length=200)
    approval_ref = serializers.CharField(max_length=300, help_text="a reference used by no other approval")


class ResumeSerializer(ActionSerializer):
    gate = serializers.CharField(max_length=200, required=False, allow_blank=True, default="",
                                 help_text="a run awaiting approval: the gate (default: the one it waits for)")
    approval_ref = serializers.CharField(max_length=300, required=False, allow_blank=True, default="",
                                         help_text="a run awaiting approval: the approval reference")


class ReasonRequiredSerializer(StrictSerializer):
    reason = serializers.CharField(max_length=1000, help_text="why (required; kept in the audit trail)")


class AcknowledgeDriftSerializer(ReasonRequiredSerializer):
    dimension = serializers.CharField(max_length=250, required=False, allow_blank=True, default="",
                                      help_text="acknowledge this dimension only (default: every open drift)")


class ErrorInfoSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()


_DATETIME = serializers.DateTimeField(read_only=True)
RUN_FIELDS = ("id", "organization_id", "project_id", "name", "status", "status_reason", "priority", "failure_mode",
              "max_agents", "attempt_number", "max_attempts", "credit_limit", "credits_reserved", "credits_charged",
              "credits_refunded", "replan_count", "mode")
RUN_TIMES = ("created_at", "updated_at", "status_changed_at", "started_at", "completed_at", "cancelled_at",
             "last_heartbeat")
# The columns ``run_as_dict`` reads: a list fetches these as plain rows (no model instances).
RUN_LIST_COLUMNS = (*RUN_FIELDS, *RUN_TIMES, "last_error_code", "last_error", "duration_ms")


def runs_as_dicts(rows) -> list[dict]:
    """``run_as_dict`` of plain rows (``values(*RUN_LIST_COLUMNS)``): a page of runs without
    building a model instance (and its state-machine bookkeeping) for each."""
    return [run_as_dict(SimpleNamespace(**row)) for row in rows]


def run_as_dict(run: Run) -> dict:
    """A run's API form (built directly: this is the hot path of GET runs/ and runs/{id}/). Its
    moments are written as DRF's ``DateTimeField`` writes them (ISO 8601 in the current time zone,
    ``Z`` for UTC), with the time zone looked up once per run instead of once per moment."""
    data = {name.removesuffix("_id"): getattr(run, name) for name in RUN_FIELDS}
    data["last_error"] = {"code": run.last_error_code, "message": run.last_error} if run.last_error_code else None
    zone = timezone.get_current_timezone()
    for name in RUN_TIMES:
        value = getattr(run, name)
        if value is None:
            data[name] = None
            continue
        written = value.astimezone(zone).isoformat() if timezone.is_aware(value) else \
            _DATETIME.to_representation(value)
        data[name] = written[:-6] + "Z" if written.endswith("+00:00") else written
    data["duration_ms"] = run.duration_ms
    return data


class RunSerializer(serializers.Serializer):
    """A run in lists: state, attempt, credits, last error and timestamps."""

    id = serializers.IntegerField()
    organization = serializers.IntegerField()
    project = serializers.IntegerField()
    name = serializers.CharField()
    status = serializers.ChoiceField(choices=Run.Status.choices)
    status_reason = serializers.CharField(allow_blank=True,
                                          help_text="why it is paused or stopped, e.g. awaiting_approval:publish")
    priority = serializers.IntegerField()
    failure_mode = serializers.ChoiceField(choices=FailureMode.choices)
    max_agents = serializers.IntegerField()
    attempt_number = serializers.IntegerField()
    max_attempts = serializers.IntegerField()
    credit_limit = serializers.IntegerField(help_text="credits reserved for each attempt")
    credits_reserved = serializers.IntegerField()
    credits_charged = serializers.IntegerField()
    credits_refunded = serializers.IntegerField()
    replan_count = serializers.IntegerField()
    mode = serializers.ChoiceField(choices=[("live", "live"), ("dryrun", "dryrun")])
    last_error = ErrorInfoSerializer(allow_null=True)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()
    status_changed_at = serializers.DateTimeField(allow_null=True)
    started_at = serializers.DateTimeField(allow_null=True)
    completed_at = serializers.DateTimeField(allow_null=True)
    cancelled_at = serializers.DateTimeField(allow_null=True)
    last_heartbeat = serializers.DateTimeField(allow_null=True)
    duration_ms = serializers.IntegerField(allow_null=True)

    def to_representation(self, instance: Run) -> dict:
        return run_as_dict(instance)


def _node_counts(run: Run) -> dict[str, dict[str, int]]:
    """Agents, tasks and steps of the run's current attempt by status, in one query."""
    agent, task, step = Agent._meta.db_table, Task._meta.db_table, Step._meta.db_table
    sql = (f"SELECT 'agents', a.status, COUNT(*) FROM {agent} a WHERE a.run_id = %s AND a.attempt_number = %s "
           f"GROUP BY a.status "
           f"UNION ALL SELECT 'tasks', t.status, COUNT(*) FROM {task} t JOIN {agent} a ON t.agent_id = a.id "
           f"WHERE t.run_id = %s AND a.attempt_number = %s GROUP BY t.status "
           f"UNION ALL SELECT 'steps', s.status, COUNT(*) FROM {step} s JOIN {task} t ON s.task_id = t.id "
           f"JOIN {agent} a ON t.agent_id = a.id WHERE s.run_id = %s AND a.attempt_number = %s GROUP BY s.status")
    counts = {level: {status: 0 for status in NodeStatus.values} for level in ("agents", "tasks", "steps")}
    with connection.cursor() as cursor:
        cursor.execute(sql, [run.pk, run.attempt_number] * 3)
        for level, status, number in cursor.fetchall():
            counts[level][status] = number
    return counts


# How many agents, tasks or steps are in each status: one count per ``NodeStatus``, in its order.
NodeCountsSerializer = type("NodeCountsSerializer", (serializers.Serializer,),
                            {status: serializers.IntegerField() for status in NodeStatus.values})


class RunCountsSerializer(serializers.Serializer):
    agents = NodeCountsSerializer()
    tasks = NodeCountsSerializer()
    steps = NodeCountsSerializer()


class DriftSerializer(serializers.Serializer):
    dimension = serializers.CharField()
    recorded = serializers.JSONField(allow_null=True)
    live = serializers.JSONField(allow_null=True)
    status = serializers.ChoiceField(choices=DriftRecord.Status.choices)


class GatePassedSerializer(serializers.Serializer):
    gate = serializers.CharField()
    check = serializers.CharField()
    finished_at = serializers.DateTimeField()


class PipelineSerializer(serializers.Serializer):
    pins = serializers.DictField(child=serializers.JSONField(allow_null=True), help_text="dimension → value")
    drift = DriftSerializer(many=True, help_text="drift of the current attempt, open or acknowledged")
    awaiting_approval = serializers.ListField(child=serializers.CharField(), help_text="gates waiting")
    gates_passed = GatePassedSerializer(many=True)


def pipeline_as_dict(run: Run) -> dict | None:
    """A gated run's pins, drift, pending approvals and passed gates (None for other runs)."""
    if not run.gated:
        return None
    from runs.pipeline.pins import pins_values

    current = {"run": run, "attempt_number": run.attempt_number}
    return {
        "pins": pins_values(run),
        "drift": [{"dimension": d.dimension, "recorded": d.recorded, "live": d.live, "status": d.status}
                  for d in DriftRecord.objects.filter(**current).order_by("id")],
        "awaiting_approval": list(ApprovalRequest.objects.filter(**current, status=ApprovalRequest.Status.PENDING)
                                  .order_by("id").values_list("gate", flat=True)),
        "gates_passed": [{"gate": r.gate, "check": r.check_name,
                          "finished_at": _DATETIME.to_representation(r.finished_at)}
                         for r in GateReceipt.objects.filter(**current, passed=True, kind=GateReceipt.Kind.GATE)
                         .order_by("id")],
    }


class RunDetailSerializer(RunSerializer):
    """A run with its plan, the counts of its current attempt's agents, tasks and steps, and (for a
    gated pipeline) its pins, drift, pending approvals and passed gates."""

    plan = PlanField()
    counts = RunCountsSerializer(help_text="agents, tasks and steps of the current attempt by status")
    pipeline = PipelineSerializer(allow_null=True, help_text="gated pipelines only")

    def to_representation(self, instance: Run) -> dict:
        return {**run_as_dict(instance), "plan": instance.plan, "counts": _node_counts(instance),
                "pipeline": pipeline_as_dict(instance)}


class EscalationSerializer(serializers.ModelSerializer):
    """A ticket; who acknowledged and resolved it is shown to non-staff callers as a member's
    username or ``operator`` (``core.api.actors``)."""

    status = serializers.ChoiceField(choices=EscalationTicket.Status.choices, read_only=True)
    triggers = serializers.ListField(child=serializers.DictField(), read_only=True,
                                     help_text="every trigger the incident gathered: trigger, at (ISO time), detail")
    acknowledged_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    resolved_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)

    class Meta:
        model = EscalationTicket
        fields = ["id", "organization", "run", "status", "trigger", "triggers", "severity", "detail", "created_at",
                  "acknowledged_at", "acknowledged_by", "resolved_at", "resolved_by", "resolution"]
        read_only_fields = fields

    def to_representation(self, instance: EscalationTicket) -> dict:
        data = super().to_representation(instance)
        names = ActorNames.for_request(self.context.get("request"))
        for field in ("acknowledged_by", "resolved_by"):
            data[field] = names.label(data[field], organization_id=instance.organization_id,
                                      user_id=getattr(instance, f"{field}_id"))
        return data


class ResolveSerializer(StrictSerializer):
    reason = serializers.CharField(max_length=1000, help_text="the resolution")
