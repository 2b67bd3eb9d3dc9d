"""Who acted, as a caller may see it.

Staff see the real actor (a username, ``system`` for the engine, ``shell:<user>`` for the shell).
A tenant sees the names of its own organization's members, ``system`` for the engine, and
``operator`` for anyone else: the console's staff and shell operators keep their names to
themselves. Used by the API's serializers and by event envelopes (REST and the live socket).
"""

from __future__ import annotations

from typing import Any

from core.models import Membership

SYSTEM = "system"
OPERATOR = "operator"
# Payload keys of events that name who acted (at the top level or one level down).
ACTOR_KEYS = frozenset({"actor", "requested_by", "acknowledged_by", "resolved_by", "approved_by"})
_CACHE_ATTRIBUTE = "_orchestrator_actor_names"


class ActorNames:
    """Labels of actors for one caller; membership answers are cached for its lifetime (a request,
    or a socket connection)."""

    def __init__(self, caller):
        self.full = bool(caller is not None and caller.is_authenticated and caller.is_active and caller.is_staff)
        self._members: dict[tuple[int, Any], bool] = {}

    @classmethod
    def for_request(cls, request) -> "ActorNames":
        """The request's instance (a serializer without a request gets the tenant's view)."""
        if request is None:
            return cls(None)
        raw = getattr(request, "_request", request)
        names = getattr(raw, _CACHE_ATTRIBUTE, None)
        if names is None:
            names = cls(getattr(request, "user", None))
            setattr(raw, _CACHE_ATTRIBUTE, names)
        return names

    def _member(self, organization_id: int | None, *, user_id: int | None, username: str) -> bool:
        if organization_id is None:
            return False
        key = (organization_id, user_id if user_id is not None else f"name:{username}")
        known = self._members.get(key)
        if known is None:
            members = Membership.objects.filter(organization_id=organization_id)
            members = members.filter(user_id=user_id) if user_id is not None else members.filter(
                user__username=username)
            known = self._members[key] = members.exists()
        return known

    def label(self, username: str | None, *, organization_id: int | None, user_id: int | None = None) -> str | None:
        """``username`` as this caller may see it. ``user_id``: the actor's id when known (better than
        the name, which another user may have taken since)."""
        if self.full or username is None or username == "":
            return username
        if username == SYSTEM and user_id is None:
            return SYSTEM
        if self._member(organization_id, user_id=user_id, username=username):
            return username
        return OPERATOR

    def may_relabel(self, envelope: dict[str, Any]) -> bool:
        """Cheap, without the database: does ``envelope`` name an actor a caller may not see?"""
        if self.full:
            return False
        for key, value in envelope.items():
            if key in ACTOR_KEYS and isinstance(value, str) and value not in ("", SYSTEM):
                return True
            if isinstance(value, dict) and any(isinstance(value.get(name), str) and value[name] not in ("", SYSTEM)
                                               for name in ACTOR_KEYS):
                return True
        return False

    def event(self, envelope: dict[str, Any]) -> dict[str, Any]:
        """An event envelope with its actors as this caller may see them (a copy when one changes)."""
        return self.relabel(envelope, organization_id=envelope.get("organization"))

    def relabel(self, data: dict[str, Any], *, organization_id: int | None) -> dict[str, Any]:
        """``data`` with the actors it names (``ACTOR_KEYS``, at the top or one level down) as this
        caller may see them; a copy when one changes."""
        if self.full:
            return data
        changed: dict[str, Any] = {}
        for key, value in data.items():
            if key in ACTOR_KEYS and isinstance(value, str):
                shown = self.label(value, organization_id=organization_id)
                if shown != value:
                    changed[key] = shown
            elif isinstance(value, dict) and ACTOR_KEYS.intersection(value):
                inner = {name: self.label(item, organization_id=organization_id)
                         if name in ACTOR_KEYS and isinstance(item, str) else item for name, item in value.items()}
                if inner != value:
                    changed[key] = inner
        return {**data, **changed} if changed else data
