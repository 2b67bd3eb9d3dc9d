"""/api/v1/ balances and the ledger."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from billing.api.views import BalanceView, LedgerViewSet

router = SimpleRouter()
router.register("ledger", LedgerViewSet, basename="ledger")

urlpatterns = [
    path("organizations/<int:pk>/balance/", BalanceView.as_view(), name="organization-balance"),
    *router.urls,
]
