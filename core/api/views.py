"""Tenancy reads (organizations, projects), a trivial ping, and JSON 404s for unknown paths."""

from __future__ import annotations

from django.http import JsonResponse
from django.urls import Resolver404, resolve
from django.views.decorators.csrf import csrf_exempt
from django_filters import rest_framework as filters
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins
from rest_framework.response import Response

from core.api.base import ApiView, ApiViewSet
from core.api.schema import errors, list_retrieve_schema
from core.api.serializers import OrganizationSerializer, PingSerializer, ProjectSerializer
from core.api.tenancy import VisibleIdFilter, visible_organizations
from core.models import Organization, Project


@extend_schema_view(
    list=extend_schema(summary="The caller's organizations", responses={200: OrganizationSerializer(many=True),
                                                                        **errors("not_found")}),
    retrieve=extend_schema(summary="An organization", responses={200: OrganizationSerializer,
                                                                 **errors("not_found")}),
)
class OrganizationViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ApiViewSet):
    queryset = Organization.objects.order_by("id")
    serializer_class = OrganizationSerializer
    entity = "organization"
    organization_field = "id"


class ProjectFilter(filters.FilterSet):
    organization = VisibleIdFilter(field_name="organization_id", entity="organization",
                                   queryset=visible_organizations)

    class Meta:
        model = Project
        fields = ["organization"]


@list_retrieve_schema(ProjectSerializer, list_summary="Projects of the caller's organizations",
                      retrieve_summary="A project")
class ProjectViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ApiViewSet):
    queryset = Project.objects.order_by("id")
    serializer_class = ProjectSerializer
    filterset_class = ProjectFilter
    entity = "project"


class PingView(ApiView):
    """The cheapest authenticated endpoint: checks credentials (and measures the stack)."""

    @extend_schema(summary="Check credentials", responses={200: PingSerializer})
    def get(self, request):
        return Response({"pong": True})


@csrf_exempt  # nothing to protect: it only answers 404 (and an HTML CSRF page would break the shape)
def api_not_found(request, *args, **kwargs):
    """Unknown paths under /api/ answer in the API's error shape."""
    detail = f"no endpoint at {request.path}"
    if not request.path.endswith("/"):
        try:
            resolved = resolve(request.path + "/")
            if resolved.func is not api_not_found:
                detail += f"; did you mean {request.path}/ ?"
        except Resolver404:
            pass
    return JsonResponse({"code": "not_found", "detail": detail}, status=404)
