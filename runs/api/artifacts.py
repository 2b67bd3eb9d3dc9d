"""Artifacts of the caller's runs: list, detail and download.

A download pushes the artifact's expiry forward before it reads the file (seed 001 §8.4:
``runs.artifacts.artifact_open``), so the prune never deletes a file under a reader; an
artifact already deleted answers ``410 artifact_expired``.
"""

from __future__ import annotations

import json

from django.http import FileResponse
from django_filters import rest_framework as filters
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, renderers, serializers
from rest_framework.decorators import action

from core.api.base import ApiViewSet
from core.api.schema import errors, list_retrieve_schema
from core.api.tenancy import VisibleIdFilter, visible
from runs.artifacts import artifact_open
from runs.models import Artifact, Run


class ArtifactSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    run = serializers.IntegerField(source="run_id")
    name = serializers.CharField()
    size_bytes = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField(allow_null=True, help_text="null until the run completes; "
                                                                      "reading the artifact pushes it forward")
    deleted_at = serializers.DateTimeField(allow_null=True, help_text="set once expired and deleted")

    class Meta:
        ref_name = "Artifact"


class BinaryRenderer(renderers.BaseRenderer):
    """Lets a download be asked for as ``application/octet-stream`` (errors are still JSON)."""

    media_type = "application/octet-stream"
    format = "bin"
    charset = None

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if isinstance(data, (bytes, bytearray)):
            return bytes(data)
        return json.dumps(data, default=str).encode("utf-8")


def _visible_runs(request):
    return visible(Run.objects.all(), request)


class ArtifactFilter(filters.FilterSet):
    run = VisibleIdFilter(field_name="run_id", entity="run", queryset=_visible_runs)


@list_retrieve_schema(
    ArtifactSerializer,
    list_summary="Artifacts of the caller's runs (by run)",
    list_description=("Artifacts (files a run's steps wrote) of runs in the caller's organizations, newest first; "
                      "filter by `run`. Expired artifacts are listed with their expiry but their files are gone."),
    retrieve_summary="An artifact",
    retrieve_description="One artifact's metadata: its run, name, size, digest and expiry.",
)
class ArtifactViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ApiViewSet):
    serializer_class = ArtifactSerializer
    filterset_class = ArtifactFilter
    entity = "artifact"
    organization_field = "run__organization_id"

    def get_queryset(self):
        self.queryset = Artifact.objects.order_by("-id")
        return super().get_queryset()

    @extend_schema(description=("The artifact's file. A download pushes the artifact's expiry out by "
                                "`ORCHESTRATOR_ARTIFACT_ACCESS_EXTENSION_S` first; an expired artifact answers 410 "
                                "`artifact_expired`."),
                   summary="Download an artifact (pushes its expiry forward first)",
                   responses={(200, "application/octet-stream"): OpenApiResponse(OpenApiTypes.BINARY),
                              **errors("not_found", "artifact_expired")})
    @action(detail=True, methods=["get"], renderer_classes=[renderers.JSONRenderer, BinaryRenderer])
    def download(self, request, pk=None):
        artifact = self.get_object()
        artifact, handle = artifact_open(artifact_id=artifact.pk)
        return FileResponse(handle, as_attachment=True, filename=artifact.name,
                            content_type="application/octet-stream")
