"""Event envelopes for REST reconciliation: the same wire form the WebSocket relay sends."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from core.api.actors import ActorNames
from core.api.tenancy import organization_ids
from core.models import Event

try:  # the live relay defines the wire form; keep one
    from core.relay import envelope as _relay_envelope
except ImportError:  # pragma: no cover - the relay is optional
    _relay_envelope = None

EVENT_FIELDS = ("id", "type", "created_at", "organization_id", "project_id", "run_id", "payload")


def event_envelope(row: dict[str, Any]) -> dict[str, Any]:
    """``{"id", "type", "ts", "organization", "project", "run", **payload}``."""
    if _relay_envelope is not None:
        return _relay_envelope(row)
    body = {"id": row["id"], "type": row["type"], "ts": row["created_at"].isoformat(),
            "organization": row["organization_id"], "project": row["project_id"], "run": row["run_id"]}
    for key, value in (row["payload"] or {}).items():
        body.setdefault(key, value)
    return body


def events_of_every_organization(user) -> bool:
    """May ``user`` read every organization's events? Staff with ``core.view_event`` only (the
    Operators group's permission alone does not open other tenants). The live socket and the REST
    feed both ask this."""
    return bool(user is not None and user.is_authenticated and user.is_active and user.is_staff
                and user.has_perm("core.view_event"))


def events_visible(request) -> QuerySet:
    """Events of the caller's organizations; staff with ``core.view_event`` see all."""
    if events_of_every_organization(request.user):
        return Event.objects.all()
    return Event.objects.filter(organization_id__in=organization_ids(request))


def event_page(request, queryset: QuerySet, *, after: int, limit: int) -> dict[str, Any]:
    """One page of events after ``after`` in id order, with the URL of the next one (actors as
    the caller may see them: ``core.api.actors``)."""
    rows = list(queryset.filter(id__gt=after).order_by("id").values(*EVENT_FIELDS)[:limit])
    last_id = rows[-1]["id"] if rows else None
    next_url = None
    if len(rows) == limit:
        query = request.query_params.copy()
        query["after"] = str(last_id)
        next_url = request.build_absolute_uri(f"{request.path}?{query.urlencode()}")
    names = ActorNames.for_request(request)
    return {"results": [names.event(event_envelope(row)) for row in rows], "next": next_url, "last_id": last_id}
