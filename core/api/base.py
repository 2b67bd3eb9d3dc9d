"""Base classes of every API view: tenancy, idempotency keys, 404s that name the object."""

from __future__ import annotations

from rest_framework import viewsets
from rest_framework.views import APIView

from core.api.idempotency import IdempotentViewMixin
from core.api.tenancy import as_id, visible, visible_project
from core.api.throttling import RateLimitedViewMixin
from core.errors import NotFound

ID_PATTERN = "[0-9]{1,18}"


class BodyCheckedMixin:
    """A body is parsed (and a malformed one refused) before the handler, also by the endpoints
    that do not read it: the same rules hold for every POST, PUT and PATCH."""

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        method = request.method.lower()
        if method in ("post", "put", "patch") and method in self.http_method_names and hasattr(self, method):
            request.data  # noqa: B018 - parsing is the point (a method not allowed stays a 405)


class ApiView(BodyCheckedMixin, RateLimitedViewMixin, IdempotentViewMixin, APIView):
    """A plain API view. POSTs name their organization with ``idempotency_organization_id``."""

    def idempotency_organization_id(self, request) -> int | None:
        return None


class ApiViewSet(BodyCheckedMixin, RateLimitedViewMixin, IdempotentViewMixin, viewsets.GenericViewSet):
    """A view set over objects of the caller's organizations.

    ``queryset`` is narrowed to the caller's organizations (through ``organization_field``);
    a detail of another organization's object answers ``404 not_found`` naming ``entity``.
    POSTs on a detail act for the object's organization; POSTs on the list for the
    organization of the ``project`` in the body.
    """

    entity = "object"
    organization_field = "organization_id"
    lookup_value_regex = ID_PATTERN

    def get_queryset(self):
        return visible(super().get_queryset(), self.request, field=self.organization_field)

    def get_object(self):
        cached = getattr(self, "_object", None)
        if cached is not None:
            return cached
        pk = self.kwargs[self.lookup_url_kwarg or self.lookup_field]
        number = as_id(pk)
        obj = self.get_queryset().filter(pk=number).first() if number else None
        if obj is None:
            raise NotFound(f"{self.entity} {pk} does not exist")
        self.check_object_permissions(self.request, obj)
        self._object = obj
        return obj

    def project_visible(self, request, pk: int):
        """The body's project, once per request (the key's organization and the handler share it)."""
        cached = getattr(self, "_project", None)
        if cached is None or cached.pk != pk:
            cached = self._project = visible_project(request, pk)
        return cached

    def idempotency_organization_id(self, request) -> int | None:
        if self.detail:
            return self.get_object().organization_id
        data = request.data
        project = as_id(data.get("project")) if isinstance(data, dict) else None
        if project is None:
            return None  # the body does not name a project: validation will say so
        return self.project_visible(request, project).organization_id

