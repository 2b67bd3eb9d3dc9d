"""/api/v1/ runs, escalations, artifacts and the event feed."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from runs.api.artifacts import ArtifactViewSet
from runs.api.views import EscalationViewSet, EventListView, RunViewSet

router = SimpleRouter()
router.register("runs", RunViewSet, basename="run")
router.register("escalations", EscalationViewSet, basename="escalation")
router.register("artifacts", ArtifactViewSet, basename="artifact")

urlpatterns = [
    path("events/", EventListView.as_view(), name="event-list"),
    *router.urls,
]
