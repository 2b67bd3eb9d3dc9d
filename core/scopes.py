"""Event scopes: what a reader of the live event stream may subscribe to.

A scope is a name (``run``, ``project``, ``organization``) and an object id; its resolver says
which organization the object belongs to (None: no such object), and that decides who may watch
it (members of the organization; staff with ``core.view_event`` see every scope, and ``all``).
``core`` resolves its own objects; an app registers the scopes of its objects in its
``AppConfig.ready`` (``runs`` registers ``run``).
"""

from __future__ import annotations

from typing import Callable

from core.models import Organization, Project

OrganizationOf = Callable[[int], "int | None"]

_RESOLVERS: dict[str, OrganizationOf] = {}


def event_scope_register(name: str, organization_of: OrganizationOf) -> None:
    """Register the scope ``name``: ``organization_of(object_id)`` is its object's organization id."""
    _RESOLVERS[name] = organization_of


def event_scope_organization(name: str, object_id: int) -> int | None:
    """The organization of the object a scope names, or None (no such scope or object)."""
    resolver = _RESOLVERS.get(name)
    return resolver(object_id) if resolver is not None else None


event_scope_register(
    "project", lambda pk: Project.objects.filter(pk=pk).values_list("organization_id", flat=True).first())
event_scope_register(
    "organization", lambda pk: Organization.objects.filter(pk=pk).values_list("pk", flat=True).first())
