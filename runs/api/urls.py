"""/api/v1/ runs, escalations and the event feed."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from runs.api.views import EscalationViewSet, EventListView, RunViewSet

router = SimpleRouter()
router.register("runs", RunViewSet, basename="run")
router.register("escalations", EscalationViewSet, basename="escalation")

urlpatterns = [
    path("events/", EventListView.as_view(), name="event-list"),
    *router.urls,
]
