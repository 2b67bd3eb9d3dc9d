"""/api/v1/ jobs and health."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from jobs.api.views import HealthView, JobViewSet, ProjectQueueViewSet

router = SimpleRouter()
router.register("jobs", JobViewSet, basename="job")
router.register("projects", ProjectQueueViewSet, basename="project-queue")

urlpatterns = [
    path("health/", HealthView.as_view(), name="health"),
    *router.urls,
]
