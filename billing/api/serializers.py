"""Credits in the API: balances and ledger entries."""

from __future__ import annotations

from rest_framework import serializers

from billing.models import LedgerEntry
from core.api.actors import ActorNames


class BalanceSerializer(serializers.Serializer):
    organization = serializers.IntegerField()
    balance = serializers.IntegerField(help_text="credits the organization owns")
    reserved = serializers.IntegerField(help_text="credits held for runs")
    available = serializers.IntegerField(help_text="balance - reserved")


class LedgerEntrySerializer(serializers.ModelSerializer):
    kind = serializers.ChoiceField(choices=LedgerEntry.Kind.choices, read_only=True)
    actor = serializers.CharField(source="actor_label", read_only=True,
                                  help_text="who moved the credits: a member's username, system, or (to "
                                            "non-staff callers) operator for the console's staff")

    class Meta:
        model = LedgerEntry
        fields = ["id", "organization", "run", "attempt_number", "kind", "source", "amount", "idempotency_key",
                  "actor", "reason", "balance_after", "reserved_after", "created_at"]
        read_only_fields = fields

    def to_representation(self, instance: LedgerEntry) -> dict:
        data = super().to_representation(instance)
        data["actor"] = ActorNames.for_request(self.context.get("request")).label(
            instance.actor_label, organization_id=instance.organization_id, user_id=instance.actor_id)
        return data
