"""/api/v1/ organizations, projects and ping."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from core.api.views import OrganizationViewSet, PingView, ProjectViewSet

router = SimpleRouter()
router.register("organizations", OrganizationViewSet, basename="organization")
router.register("projects", ProjectViewSet, basename="project")

urlpatterns = [
    path("ping/", PingView.as_view(), name="ping"),
    *router.urls,
]
