"""/api/v1/ jobs and health."""

from django.urls import path
from rest_framework.routers import SimpleRouter

from jobs.api.views import HealthView, JobViewSet

router = SimpleRouter()
router.register("jobs", JobViewSet, basename="job")

urlpatterns = [
    path("health/", HealthView.as_view(), name="health"),
    *router.urls,
]
