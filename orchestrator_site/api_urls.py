"""The API under /api/: each app's /v1/ endpoints, the OpenAPI schema and its docs page, the
AsyncAPI document of /ws/events/.

Unknown paths under /api/ answer the API's JSON 404, not an HTML page.
"""

from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from core.api.views import api_not_found
from core.asyncapi import AsyncAPIView

urlpatterns = [
    path("v1/", include("core.api.urls")),
    path("v1/", include("diagnosis.api")),
    path("v1/", include("runs.api.urls")),
    path("v1/", include("jobs.api.urls")),
    path("v1/", include("billing.api.urls")),
    path("schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("asyncapi.yaml", AsyncAPIView.as_view(), name="asyncapi-yaml"),
    path("schema/asyncapi/", AsyncAPIView.as_view(as_json=True), name="asyncapi-json"),
    path("docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
    re_path(r"^[\s\S]*$", api_not_found),  # any path, even with a newline
]
