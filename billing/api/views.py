"""Balances and the append-only ledger (read-only)."""

from __future__ import annotations

from django_filters import rest_framework as filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins
from rest_framework.response import Response

from billing.api.serializers import BalanceSerializer, LedgerEntrySerializer
from billing.models import LedgerEntry
from billing.selectors import account_balance
from core.api.base import ApiView, ApiViewSet
from core.api.pagination import KeysetPagination
from core.api.schema import errors, list_retrieve_schema
from core.api.tenancy import VisibleIdFilter, visible_get, visible_organizations


class BalanceView(ApiView):
    @extend_schema(description=("The organization's credit balance, the credits reserved by its runs and those "
                                "available for new runs."),
                   summary="An organization's credits: balance, reserved, available",
                   responses={200: BalanceSerializer, **errors("not_found")})
    def get(self, request, pk: int):
        organization = visible_get(visible_organizations(request), request, pk, entity="organization", field="id")
        return Response(account_balance(organization_id=organization.pk))


class LedgerFilter(filters.FilterSet):
    organization = VisibleIdFilter(field_name="organization_id", entity="organization",
                                   queryset=visible_organizations)
    run = VisibleIdFilter(field_name="run_id", entity="run")  # a run the caller sees (core.scopes)
    kind = filters.ChoiceFilter(choices=LedgerEntry.Kind.choices)

    class Meta:
        model = LedgerEntry
        fields = ["organization", "run", "kind"]


@list_retrieve_schema(
    LedgerEntrySerializer,
    list_summary="Ledger entries of the caller's organizations (by run, kind)",
    list_description=("The append-only credit ledger of the caller's organizations, newest first; filter by `run` "
                      "and `kind` (topup, reserve, charge, refund)."),
    retrieve_summary="A ledger entry",
    retrieve_description="One ledger entry: kind, amount, the balance after it, its run and its hash-chain link.",
)
class LedgerViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ApiViewSet):
    queryset = LedgerEntry.objects.order_by("-id")
    pagination_class = KeysetPagination
    serializer_class = LedgerEntrySerializer
    filterset_class = LedgerFilter
    entity = "ledger entry"
