"""Tenancy reads (organizations, projects), a trivial ping, and JSON 404s for unknown paths."""

from __future__ import annotations

from django.http import JsonResponse
from django.urls import Resolver404, resolve
from django.views.decorators.csrf import csrf_exempt
from django_filters import rest_framework as filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins
from rest_framework.response import Response

from core.api.base import ApiView, ApiViewSet
from core.api.schema import list_retrieve_schema
from core.api.serializers import OrganizationSerializer, PingSerializer, ProjectSerializer
from core.api.tenancy import VisibleIdFilter, visible_organizations
from core.models import Organization, Project


@list_retrieve_schema(
    OrganizationSerializer,
    list_summary="The caller's organizations",
    list_description="The organizations the authenticated user is a member of.",
    retrieve_summary="An organization",
    retrieve_description="One of the caller's organizations; any other id answers 404.",
    filtered=False,
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


@list_retrieve_schema(
    ProjectSerializer,
    list_summary="Projects of the caller's organizations",
    list_description="Projects of the organizations the caller is a member of; filter by `organization`.",
    retrieve_summary="A project",
    retrieve_description="One project of the caller's organizations, with its retention.",
)
class ProjectViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ApiViewSet):
    queryset = Project.objects.order_by("id")
    serializer_class = ProjectSerializer
    filterset_class = ProjectFilter
    entity = "project"


class PingView(ApiView):
    """The cheapest authenticated endpoint: checks credentials (and measures the stack)."""

    @extend_schema(description=("Answers `{\"pong\": true}` to an authenticated caller: the cheapest way to check a "
                                "token or a session."),
                   summary="Check credentials", responses={200: PingSerializer})
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
