"""Tenancy for the API: a caller sees the objects of the organizations it is a member of.

Another organization's object answers ``404 not_found`` exactly like one that does not exist,
in details, actions and list filters alike, so ids never leak across organizations.
"""

from __future__ import annotations

from typing import Any, Callable

import django_filters
from django import forms
from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field

from core.errors import NotFound
from core.models import Membership, Project
from core.scopes import event_scope_organization

MAX_ID = 2**63 - 1
_CACHE_ATTRIBUTE = "_orchestrator_organization_ids"


def organization_ids(request) -> list[int]:
    """Ids of the caller's organizations (read once per request)."""
    raw = getattr(request, "_request", request)
    cached = getattr(raw, _CACHE_ATTRIBUTE, None)
    if cached is not None:
        return cached
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        ids: list[int] = []
    else:
        ids = list(Membership.objects.filter(user=user).values_list("organization_id", flat=True))
    setattr(raw, _CACHE_ATTRIBUTE, ids)
    return ids


def as_id(value: Any) -> int | None:
    """``value`` as a database id, or None when it cannot be one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and value.isdigit() and len(value) <= 19:
        number = int(value)
    else:
        return None
    return number if 1 <= number <= MAX_ID else None


def visible(queryset: QuerySet, request, *, field: str = "organization_id") -> QuerySet:
    return queryset.filter(**{f"{field}__in": organization_ids(request)})


def visible_get(queryset: QuerySet, request, pk: Any, *, entity: str, field: str = "organization_id"):
    """The object ``pk`` of ``queryset`` if the caller may see it, else ``NotFound``."""
    number = as_id(pk)
    obj = visible(queryset, request, field=field).filter(pk=number).first() if number else None
    if obj is None:
        raise NotFound(f"{entity} {pk} does not exist")
    return obj


def visible_project(request, pk: Any) -> Project:
    return visible_get(Project.objects.select_related("organization"), request, pk, entity="project")


@extend_schema_field(OpenApiTypes.INT)
class VisibleIdFilter(django_filters.Filter):
    """Filter by the id of an object the caller must be able to see (else ``404 not_found``): an
    object of ``queryset(request)``, or, for an object of an app above this one, of the event scope
    ``entity`` (``core.scopes``: its organization is one of the caller's)."""

    field_class = forms.IntegerField

    def __init__(self, *args, entity: str, queryset: Callable[[Any], QuerySet] | None = None, **kwargs):
        kwargs.setdefault("min_value", 1)
        kwargs.setdefault("max_value", MAX_ID)
        super().__init__(*args, **kwargs)
        self.entity = entity
        self.visible_queryset = queryset

    def filter(self, qs, value):
        if value in (None, ""):
            return qs
        request = self.parent.request
        if self.visible_queryset is not None:
            seen = self.visible_queryset(request).filter(pk=value).exists()
        else:
            seen = event_scope_organization(self.entity, value) in organization_ids(request)
        if not seen:
            raise NotFound(f"{self.entity} {value} does not exist")
        return qs.filter(**{self.field_name: value})


def visible_projects(request) -> QuerySet:
    return visible(Project.objects.all(), request)


def visible_organizations(request) -> QuerySet:
    from core.models import Organization

    return Organization.objects.filter(pk__in=organization_ids(request))
