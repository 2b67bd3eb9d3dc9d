"""URL map of the console: the admin at the root of /admin/."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

from core.admin_login import RateLimitedAdminLoginForm
from core.metrics import metrics_view

admin.site.login_form = RateLimitedAdminLoginForm

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False)),
    path("admin/dashboard/", include("console.admin_dashboard")),
    path("admin/", admin.site.urls),
    path("api/", include("orchestrator_site.api_urls")),
    path("metrics", metrics_view, name="metrics"),
]
