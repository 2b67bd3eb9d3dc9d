"""Serializers of tenancy, events and health."""

from __future__ import annotations

from rest_framework import serializers

from core.api.tenancy import MAX_ID
from core.models import Organization, Project


class StrictSerializer(serializers.Serializer):
    """A request body's serializer: a key it does not declare is refused (``400`` naming the field),
    never silently ignored (a misspelt option would otherwise be dropped without a word)."""

    def to_internal_value(self, data):
        if hasattr(data, "keys"):
            unknown = sorted(str(key) for key in data.keys() if key not in self.fields or self.fields[key].read_only)
            if unknown:
                raise serializers.ValidationError({key: ["unknown field: not accepted here"] for key in unknown})
        return super().to_internal_value(data)


class OrganizationSerializer(serializers.ModelSerializer):
    class Meta:
        model = Organization
        fields = ["id", "name", "created_at"]
        read_only_fields = fields


class ProjectSerializer(serializers.ModelSerializer):
    class Meta:
        model = Project
        fields = ["id", "organization", "name", "created_at"]
        read_only_fields = fields


class EventSerializer(serializers.Serializer):
    """An event envelope: fixed fields, then the event's own payload fields."""

    id = serializers.IntegerField()
    type = serializers.CharField()
    ts = serializers.DateTimeField()
    organization = serializers.IntegerField(allow_null=True)
    project = serializers.IntegerField(allow_null=True)
    run = serializers.IntegerField(allow_null=True)


class EventPageSerializer(serializers.Serializer):
    results = EventSerializer(many=True)
    next = serializers.CharField(allow_null=True, help_text="the URL of the next page (null: caught up)")
    last_id = serializers.IntegerField(allow_null=True, help_text="pass it as `after` to read on")


class EventQuerySerializer(serializers.Serializer):
    after = serializers.IntegerField(min_value=0, max_value=MAX_ID, default=0,
                                     help_text="only events with a larger id")
    limit = serializers.IntegerField(min_value=1, max_value=500, default=100)
    run = serializers.IntegerField(min_value=1, max_value=MAX_ID, required=False)
    project = serializers.IntegerField(min_value=1, max_value=MAX_ID, required=False)
    organization = serializers.IntegerField(min_value=1, max_value=MAX_ID, required=False)


class HealthPartSerializer(serializers.Serializer):
    ok = serializers.BooleanField()
    detail = serializers.CharField(required=False)


class HealthSerializer(serializers.Serializer):
    """Anonymous callers get ``status`` only; staff and the metrics token get the parts too."""

    status = serializers.ChoiceField(choices=["ok", "failing"])
    failing = serializers.ListField(child=serializers.CharField(), required=False,
                                    help_text="names of the failing parts (staff or metrics token)")
    database = serializers.DictField(required=False)
    broker = serializers.DictField(required=False)
    workers = serializers.DictField(required=False)
    relay = serializers.JSONField(required=False, help_text='the relay cursor and its lag, or "not running"')
    queue = serializers.DictField(required=False)


class PingSerializer(serializers.Serializer):
    pong = serializers.BooleanField()


def _contains_nul(value) -> bool:
    """Without recursion: a value may come from elsewhere than the API's depth-limited parser."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if "\x00" in node:
                return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def json_without_nul(value) -> None:
    """JSON fields: PostgreSQL cannot store a NUL character (``\\u0000``) in text or jsonb."""
    if _contains_nul(value):
        raise serializers.ValidationError("must not contain NUL (\\u0000) characters")
