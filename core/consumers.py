"""``/ws/events/``: authenticated, tenant-limited event streams with replay.

Protocol (JSON messages):
- authenticate with the session cookie, or send ``{"action": "auth", "token": "<api token>"}``
  first (never in the URL); unauthenticated sockets are closed with code 4401. A wrong token
  counts as a failed authentication of the client's address, as on the API; once the address
  has spent its allowance an ``auth`` is answered ``{"type": "error", "code": "rate_limited",
  "retry_after": s}`` and the socket closed with code 4429, without the token being checked;
- ``{"action": "subscribe", "run": id}`` (or ``"project"``, ``"organization"``, or
  ``"all": true`` for staff), optionally with ``"after": <event id>``: events after that id are
  replayed from the database, then the stream goes live, in id order, without gaps or duplicates;
- ``{"action": "unsubscribe", ...}`` with the same keys.
Server messages: event envelopes (``{"id", "type", "ts", "organization", "project", "run", ...}``),
``{"type": "subscribed", ...}``, ``{"type": "error", "code", "detail"}``. A message that is not
a JSON text frame the API would accept as a body (too deep: ``json_too_deep``; otherwise
``invalid_json`` or ``bad_message``) gets an error frame and the connection stays open.
"""

from __future__ import annotations

import asyncio
import logging

from channels.db import database_sync_to_async as sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from core.api.parsers import JsonRefused, json_loads_checked
from core.api.tenancy import MAX_ID
from core.ratelimit import auth_failure_record, auth_failures_refusal, client_address, retry_after_text
from core.relay import Relay, Subscriber, envelope, events_after
from core.scopes import event_scope_organization
from core.api.events import events_of_every_organization

logger = logging.getLogger("orchestrator.relay")

CLOSE_UNAUTHENTICATED = 4401
CLOSE_RATE_LIMITED = 4429
AUTH_TIMEOUT_S = 10
SCOPES = ("run", "project", "organization")


def _is_id(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 1 <= value <= MAX_ID


def _user_from_token(key: str):
    from django.apps import apps

    if not apps.is_installed("rest_framework.authtoken"):
        return None
    from rest_framework.authtoken.models import Token

    token = Token.objects.select_related("user").filter(key=key).first()
    if token is None or not token.user.is_active:
        return None
    return token.user


def _access(user, scope: str, object_id) -> tuple[bool, str, int | None]:
    """May ``user`` watch this scope? Returns (allowed, group, organization)."""
    sees_all = events_of_every_organization(user)
    if scope == "all":
        return sees_all, "all", None
    if isinstance(object_id, bool) or not isinstance(object_id, int):
        return False, "", None
    organization = event_scope_organization(scope, object_id)
    if organization is None:
        return False, "", None
    allowed = sees_all or user.memberships.filter(organization_id=organization).exists()
    return allowed, f"{scope}.{object_id}", organization


class EventConsumer(AsyncJsonWebsocketConsumer):
    """Relays committed events to one client (see the module docstring for the protocol)."""

    async def connect(self):
        self.user = None
        self.subscriber = Subscriber()
        self.last_sent = 0
        self.sender: asyncio.Task | None = None
        self.auth_timer: asyncio.Task | None = None
        self.replaying = False
        self.stream_start: int | None = None  # the relay cursor when the first group was registered
        # group -> the ``after`` of its subscription where that is ahead of the relay's cursor
        # (a client coming from a process whose relay was further on): the live events of that
        # group up to there were sent before and are not sent again.
        self.floors: dict[str, int] = {}
        await self.accept()
        user = self.scope.get("user")
        if user is not None and user.is_authenticated:
            await self._authenticated(user)
        else:
            self.auth_timer = asyncio.get_running_loop().create_task(self._require_auth())

    async def _require_auth(self):
        await asyncio.sleep(AUTH_TIMEOUT_S)
        if self.user is None:
            await self.close(code=CLOSE_UNAUTHENTICATED)

    async def _authenticated(self, user):
        from core.api.actors import ActorNames

        self.user = user
        self.actor_names = ActorNames(user)  # who acted, as this user may see it
        if self.auth_timer is not None:
            self.auth_timer.cancel()
        self.relay = await Relay.get()
        self.sender = asyncio.get_running_loop().create_task(self._send_live())
        await self.send_json({"type": "hello", "user": user.get_username(), "cursor": self.relay.cursor})

    async def disconnect(self, code):
        if getattr(self, "relay", None) is not None:
            self.relay.unsubscribe(self.subscriber)
        for task in (self.sender, self.auth_timer):
            if task is not None:
                task.cancel()

    async def receive(self, text_data=None, bytes_data=None, **kwargs):
        """A message that is not JSON text the API would accept gets an error frame; the
        connection stays open (an unauthenticated one is closed, as for any other message)."""
        if text_data is None:
            await self._error("bad_message", "messages are JSON text frames")
        else:
            try:
                content = json_loads_checked(text_data)
            except JsonRefused as exc:
                extra = {"max_depth": exc.max_depth} if exc.max_depth is not None else {}
                await self._error(exc.code, exc.detail, **extra)
            else:
                return await self.receive_json(content, **kwargs)
        if self.user is None:
            await self.close(code=CLOSE_UNAUTHENTICATED)

    async def receive_json(self, content, **kwargs):
        if not isinstance(content, dict):
            return await self._error("bad_message", "messages are JSON objects")
        action = content.get("action")
        if action == "auth":
            if self.user is not None:
                return await self.send_json({"type": "hello", "user": self.user.get_username()})
            address = self._client_address()
            refusal = await sync_to_async(auth_failures_refusal)(address)
            if refusal is not None:
                await self._error("rate_limited", "too many failed authentications from this address; try again "
                                  f"in {retry_after_text(refusal.retry_after_s)}", retry_after=refusal.retry_after_s)
                return await self.close(code=CLOSE_RATE_LIMITED)
            token = content.get("token")
            user = await sync_to_async(_user_from_token)(token) if isinstance(token, str) and token else None
            if user is None:
                await sync_to_async(auth_failure_record)(address)
                return await self.close(code=CLOSE_UNAUTHENTICATED)
            return await self._authenticated(user)
        if self.user is None:
            return await self.close(code=CLOSE_UNAUTHENTICATED)
        if action == "subscribe":
            return await self._subscribe(content)
        if action == "unsubscribe":
            return await self._unsubscribe(content)
        if action == "ping":
            return await self.send_json({"type": "pong", "cursor": self.relay.cursor})
        return await self._error("bad_message", f"unknown action {action!r}")

    def _client_address(self) -> str:
        """The client's address, as the API's limits see it (trusted proxies included)."""
        client = self.scope.get("client") or ("", 0)
        meta = {"REMOTE_ADDR": client[0] or ""}
        forwarded = [value for name, value in self.scope.get("headers", []) if name.lower() == b"x-forwarded-for"]
        if forwarded:
            meta["HTTP_X_FORWARDED_FOR"] = b",".join(forwarded).decode("latin-1")
        return client_address(meta)

    async def _error(self, code: str, detail: str, **extra):
        await self.send_json({"type": "error", "code": code, "detail": detail, **extra})

    def _scope_of(self, content) -> tuple[str, object] | None:
        if content.get("all") is True:
            return "all", True
        for scope in SCOPES:
            if scope in content:
                return scope, content[scope]
        return None

    async def _subscribe(self, content):
        target = self._scope_of(content)
        if target is None:
            return await self._error("bad_message", "subscribe to a run, project, organization or all")
        scope, object_id = target
        again = ("all" if scope == "all" else f"{scope}.{object_id}") in self.subscriber.groups
        if not again and len(self.subscriber.groups) >= settings.ORCHESTRATOR_WS_MAX_SUBSCRIPTIONS:
            return await self._error("too_many_subscriptions",
                                     f"at most {settings.ORCHESTRATOR_WS_MAX_SUBSCRIPTIONS} per connection")
        if scope != "all" and not _is_id(object_id):
            return await self._error("bad_message", f"{scope} must be an id from 1 to {MAX_ID}")
        after = content.get("after")
        if after is not None and (isinstance(after, bool) or not isinstance(after, int) or not 0 <= after <= MAX_ID):
            return await self._error("bad_message", f"after must be an event id from 0 to {MAX_ID}")
        allowed, group, organization = await sync_to_async(_access)(self.user, scope, object_id)
        if not allowed:
            return await self._error("forbidden", f"no access to {scope} {object_id}", scope=scope)
        # Register first: everything after the relay's cursor arrives live; replay the rest. Live
        # delivery is held from here until the replay is done (the stream stays in id order:
        # a live event sent first would make the replayed, older ones look like duplicates).
        self.replaying = True
        try:
            earlier_groups = bool(self.subscriber.groups)
            cursor = self.relay.subscribe(self.subscriber, group)
            if self.stream_start is None:
                self.stream_start = cursor
            if after is not None and after > cursor:
                self.floors[group] = after
            await self.send_json({"type": "subscribed", "scope": scope, "id": object_id, "cursor": cursor})
            if after is not None and after < cursor:
                if earlier_groups:
                    await self._replay_merged(after, cursor, group)
                else:
                    await self._replay(after, cursor, scope, object_id)
        finally:
            self.replaying = False

    async def _unsubscribe(self, content):
        target = self._scope_of(content)
        if target is None:
            return await self._error("bad_message", "unsubscribe from a run, project, organization or all")
        scope, object_id = target
        group = "all" if scope == "all" else f"{scope}.{object_id}"
        members = self.relay.groups.get(group)
        if members is not None:
            members.discard(self.subscriber)
        self.subscriber.groups.discard(group)
        self.floors.pop(group, None)
        await self.send_json({"type": "unsubscribed", "scope": scope, "id": object_id})

    async def _replay(self, after: int, upto: int, scope: str, object_id):
        filters = {} if scope == "all" else {scope if scope != "organization" else "organizations":
                                              object_id if scope != "organization" else [object_id]}
        position = after
        while position < upto:
            rows = await sync_to_async(events_after, thread_sensitive=False)(position, upto=upto, **filters)
            if not rows:
                break
            for row in rows:
                await self._deliver(envelope(row))
            position = rows[-1]["id"]

    async def _replay_merged(self, after: int, upto: int, group: str):
        """Replay for a further subscription: events of earlier subscriptions up to ``upto`` may
        still wait in the live buffer, and the new group's replay must not overtake them. So
        replay every group of this connection, in id order, from the older of ``after`` and what
        the stream has reached; the buffered copies are then dropped as already sent."""
        start = min(after, max(self.last_sent, self.stream_start or 0))
        await self._send_subscribed(start, upto, new_group=(group, after))

    async def _send_subscribed(self, position: int, upto: int, *, new_group: tuple[str, int] | None = None):
        """Send the events in ``(position, upto]`` that match any group of this connection, from
        the database in id order; ``new_group`` ``(group, after)``: not those only it matches up to ``after``."""
        from core.relay import groups_of

        organizations = await self._organizations_filter()
        while position < upto:
            rows = await sync_to_async(events_after, thread_sensitive=False)(position, upto=upto,
                                                                             organizations=organizations)
            if not rows:
                break
            for row in rows:
                event = envelope(row)
                matched = set(groups_of(event)) & self.subscriber.groups
                if not matched or (new_group and matched == {new_group[0]} and event["id"] <= new_group[1]):
                    continue
                if self.floors and self._below_floors(event):
                    continue
                await self._deliver(event)
            position = rows[-1]["id"]

    async def _organizations_filter(self) -> list[int] | None:
        """The organizations this user's events may come from (None: every one)."""
        if await sync_to_async(events_of_every_organization)(self.user):
            return None
        return await sync_to_async(lambda: list(self.user.memberships.values_list("organization_id", flat=True)))()

    async def _deliver(self, event: dict):
        if event["id"] <= self.last_sent:
            return  # already sent through another subscription or the replay
        self.last_sent = event["id"]
        if self.actor_names.may_relabel(event):
            event = await sync_to_async(self.actor_names.event, thread_sensitive=False)(event)
        await self.send_json(event)

    def _below_floors(self, event: dict) -> bool:
        """True when every group of this connection the event matches had it sent before."""
        from core.relay import groups_of

        matched = set(groups_of(event)) & self.subscriber.groups
        return bool(matched) and all(event["id"] <= self.floors.get(group, 0) for group in matched)

    async def _send_live(self):
        try:
            while True:
                event = await self.subscriber.queue.get()
                while self.replaying:
                    await asyncio.sleep(0.005)
                if not (self.floors and self._below_floors(event)):
                    await self._deliver(event)
                    if self.floors and event["id"] >= max(self.floors.values()):
                        self.floors.clear()  # every later event is above them
                if self.subscriber.overflowed and self.subscriber.queue.empty():
                    await self._catch_up()
        except asyncio.CancelledError:
            pass
        except Exception:
            logger.exception("event stream to a client failed")

    async def _catch_up(self):
        """The client fell behind the buffer: read what it missed from the database."""
        self.subscriber.overflowed = False
        await self._send_subscribed(self.last_sent, self.relay.cursor or 0)
