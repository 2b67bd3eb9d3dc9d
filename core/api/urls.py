"""/api/v1/ organizations, projects, artifacts and ping."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from core.api.artifacts import ArtifactViewSet
from core.api.views import OrganizationViewSet, PingView, ProjectViewSet

router = SimpleRouter()
router.register("organizations", OrganizationViewSet, basename="organization")
router.register("projects", ProjectViewSet, basename="project")
router.register("artifacts", ArtifactViewSet, basename="artifact")

urlpatterns = [
    path("ping/", PingView.as_view(), name="ping"),
    *router.urls,
]
