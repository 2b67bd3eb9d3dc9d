"""Runs, their actions and escalations in the API (snake_case, DESIGN §6)."""

from __future__ import annotations

from django.db.models import Count
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from core.api.tenancy import MAX_ID
from runs.models import Agent, EscalationTicket, FailureMode, NodeStatus, Run, Step, Task

NAME_SCHEMA = {"type": "string", "minLength": 1, "maxLength": 200}
PLAN_SCHEMA = {
    "type": "object",
    "description": "agents → tasks → steps (DESIGN §2.2); validated with field-level errors",
    "required": ["agents"],
    "properties": {
        "max_agents": {"type": "integer", "minimum": 1, "maximum": 100},
        "pins": {"type": "object"},
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
                        "steps": {"type": "array", "minItems": 1, "items": {
                            "type": "object", "required": ["name"],
                            "properties": {
                                "name": NAME_SCHEMA,
                                "kind": {"type": "string", "enum": Step.Kind.values},
                                "tool": {"type": "string", "description": "echo, sleep, http_request, fail ..."},
                                "args": {"type": "object"},
                                "check": {"type": "string"},
                                "gate": {"type": "string"},
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


class RunCreateSerializer(serializers.Serializer):
    project = serializers.IntegerField(min_value=1, max_value=MAX_ID)
    name = serializers.CharField(max_length=200)
    plan = PlanField()
    priority = serializers.IntegerField(min_value=-1000, max_value=1000, default=100, help_text="lower runs first")
    failure_mode = serializers.ChoiceField(choices=FailureMode.choices, default=FailureMode.FAIL_FAST)
    max_attempts = serializers.IntegerField(min_value=1, max_value=10, default=3)
    credit_limit = serializers.IntegerField(min_value=1, max_value=10**15, required=False, allow_null=True,
                                            help_text="credits reserved per attempt (default: the plan's "
                                                      "worst-case cost)")
    reason = serializers.CharField(max_length=1000, required=False, allow_blank=True, default="")


class ActionSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=1000, required=False, allow_blank=True, default="",
                                   help_text="why (kept in the audit trail)")


class ApproveSerializer(ActionSerializer):
    gate = serializers.CharField(max_length=200)
    approval_ref = serializers.CharField(max_length=300, help_text="a reference used by no other approval")


class ErrorInfoSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()


class RunSerializer(serializers.ModelSerializer):
    """A run in lists: state, attempt, credits, last error and timestamps."""

    status = serializers.ChoiceField(choices=Run.Status.choices, read_only=True)
    last_error = serializers.SerializerMethodField()

    class Meta:
        model = Run
        fields = ["id", "organization", "project", "name", "status", "status_reason", "priority", "failure_mode",
                  "max_agents", "attempt_number", "max_attempts", "credit_limit", "credits_reserved",
                  "credits_charged", "credits_refunded", "replan_count", "last_error", "created_at",
                  "updated_at", "status_changed_at", "started_at", "completed_at", "cancelled_at", "duration_ms",
                  "last_heartbeat"]
        read_only_fields = fields

    @extend_schema_field(ErrorInfoSerializer(allow_null=True))
    def get_last_error(self, run: Run):
        if not run.last_error_code:
            return None
        return {"code": run.last_error_code, "message": run.last_error}


def _counts(queryset) -> dict[str, int]:
    counts = {status: 0 for status in NodeStatus.values}
    for row in queryset.values("status").annotate(n=Count("id")).order_by():
        counts[row["status"]] = row["n"]
    return counts


class NodeCountsSerializer(serializers.Serializer):
    pending = serializers.IntegerField()
    running = serializers.IntegerField()
    paused = serializers.IntegerField()
    completed = serializers.IntegerField()
    failed = serializers.IntegerField()
    skipped = serializers.IntegerField()
    cancelled = serializers.IntegerField()


class RunCountsSerializer(serializers.Serializer):
    agents = NodeCountsSerializer()
    tasks = NodeCountsSerializer()
    steps = NodeCountsSerializer()


class RunDetailSerializer(RunSerializer):
    """A run with its plan and the counts of its current attempt's agents, tasks and steps."""

    plan = PlanField(read_only=True)
    counts = serializers.SerializerMethodField(help_text="agents, tasks and steps of the current attempt by status")

    class Meta(RunSerializer.Meta):
        fields = RunSerializer.Meta.fields + ["plan", "counts"]
        read_only_fields = fields

    @extend_schema_field(RunCountsSerializer)
    def get_counts(self, run: Run):
        attempt = run.attempt_number
        return {
            "agents": _counts(Agent.objects.filter(run=run, attempt_number=attempt)),
            "tasks": _counts(Task.objects.filter(run=run, agent__attempt_number=attempt)),
            "steps": _counts(Step.objects.filter(run=run, task__agent__attempt_number=attempt)),
        }


class EscalationSerializer(serializers.ModelSerializer):
    status = serializers.ChoiceField(choices=EscalationTicket.Status.choices, read_only=True)
    acknowledged_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)
    resolved_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)

    class Meta:
        model = EscalationTicket
        fields = ["id", "organization", "run", "status", "trigger", "severity", "detail", "created_at",
                  "acknowledged_at", "acknowledged_by", "resolved_at", "resolved_by", "resolution"]
        read_only_fields = fields


class ResolveSerializer(serializers.Serializer):
    reason = serializers.CharField(max_length=1000, help_text="the resolution")
