"""The AsyncAPI 3.0 document of ``/ws/events/``, built from the code it describes.

The client messages (``auth``, ``subscribe``, ``unsubscribe``, ``ping``) and the server's
frames (``hello``, ``subscribed``, ``unsubscribed``, ``pong``, ``error``) follow
``core.consumers``; the events are declared next to the services that write them: every
installed app's ``events.py`` lists its ``EventMessage``s in ``EVENT_MESSAGES`` (one message
per event type, the status families expanded from the models' choices), so a new status or
event type shows up here, and the test that validates real events against this document fails
on an event type nobody declared.

Served as YAML at ``/api/asyncapi.yaml`` and as JSON at ``/api/schema/asyncapi/``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import import_module
from typing import Any

import yaml
from django.apps import apps
from django.http import HttpResponse
from django.utils.module_loading import module_has_submodule
from rest_framework.permissions import AllowAny
from rest_framework.views import APIView

ASYNCAPI_VERSION = "3.0.0"
CHANNEL = "events"
ADDRESS = "/ws/events/"

# Schema fragments the apps' declarations share.
INTEGER = {"type": "integer"}
ID = {"type": "integer", "minimum": 1}
STRING = {"type": "string"}
TIMESTAMP = {"type": "string", "format": "date-time"}
ANY = {}


def nullable(schema: dict) -> dict:
    """``schema`` or ``null`` (JSON Schema draft 7, which AsyncAPI 3.0 schema objects extend)."""
    return {"oneOf": [schema, {"type": "null"}]}


def ref(name: str) -> dict:
    """A reference to ``components.schemas.<name>``."""
    return {"$ref": f"#/components/schemas/{name}"}


@dataclass(frozen=True)
class EventMessage:
    """One or more event types sharing a payload: ``properties``/``required`` are the keys the
    event adds to the envelope (``id``, ``type``, ``ts``, ``organization``, ``project``, ``run``);
    a payload key the envelope already has is sent with the envelope's value. ``schemas``: named
    schemas the properties refer to with ``ref(name)``."""

    types: tuple[str, ...]
    summary: str
    properties: dict[str, dict]
    required: tuple[str, ...] = ()
    family: str = ""
    schemas: dict[str, dict] = field(default_factory=dict)


ENVELOPE_PROPERTIES: dict[str, dict] = {
    "id": {**ID, "description": "the event's id: streams are in id order; resume with `after`"},
    "type": {**STRING, "description": "the event type"},
    "ts": {**TIMESTAMP, "description": "when the event was written (its transaction's time)"},
    "organization": {**nullable(ID), "description": "the organization it belongs to (null: none)"},
    "project": {**nullable(ID), "description": "the project it belongs to (null: none)"},
    "run": {**nullable(ID), "description": "the run it belongs to (null: none)"},
}


def event_messages() -> list[EventMessage]:
    """Every installed app's ``events.EVENT_MESSAGES``, in app order."""
    messages: list[EventMessage] = []
    for config in apps.get_app_configs():
        if module_has_submodule(config.module, "events"):
            module = import_module(f"{config.name}.events")
            messages.extend(getattr(module, "EVENT_MESSAGES", ()))
    return messages


def event_types() -> dict[str, EventMessage]:
    """Event type → its declaration (a type declared twice is a programming error)."""
    by_type: dict[str, EventMessage] = {}
    for message in event_messages():
        for event_type in message.types:
            if event_type in by_type:
                raise ValueError(f"event type {event_type!r} is declared twice")
            by_type[event_type] = message
    return by_type


def _event_payload(event_type: str, message: EventMessage) -> dict:
    properties = dict(ENVELOPE_PROPERTIES)
    properties["type"] = {"const": event_type, "description": "the event type"}
    for key, schema in message.properties.items():
        properties.setdefault(key, schema)  # the envelope's keys win on the wire (core.relay.envelope)
    return {"type": "object", "properties": properties,
            "required": [*ENVELOPE_PROPERTIES, *(key for key in message.required if key not in ENVELOPE_PROPERTIES)],
            "additionalProperties": False}


def _frame(summary: str, properties: dict, required: list[str], *, strict: bool = True, **extra) -> dict:
    return {"summary": summary, "payload": {"type": "object", "properties": properties, "required": required,
                                            "additionalProperties": not strict, **extra}}


SCOPE_KEYS = {
    "run": {**ID, "description": "a run's id"},
    "project": {**ID, "description": "a project's id"},
    "organization": {**ID, "description": "an organization's id"},
    "all": {"const": True, "description": "every event (staff with `core.view_event`)"},
}


def _scope_choice(extra: dict) -> list[dict]:
    return [{"required": [scope], "properties": {scope: schema, **extra}} for scope, schema in SCOPE_KEYS.items()]


def _client_messages() -> dict[str, dict]:
    from django.conf import settings

    after = {"type": "integer", "minimum": 0,
             "description": "replay the scope's events with a larger id from the database first, then go live"}
    return {
        "auth": _frame(
            "Authenticate with an API token (the first message when the socket has no session cookie)",
            {"action": {"const": "auth"}, "token": {"type": "string", "minLength": 1}}, ["action", "token"],
            strict=False),
        "subscribe": _frame(
            "Follow a run, a project, an organization, or everything",
            {"action": {"const": "subscribe"}, "after": after, **SCOPE_KEYS}, ["action"], strict=False,
            oneOf=_scope_choice({}),
            description=f"At most {settings.ORCHESTRATOR_WS_MAX_SUBSCRIPTIONS} subscriptions per connection "
                        f"(`ORCHESTRATOR_WS_MAX_SUBSCRIPTIONS`); subscribing again to the same scope is allowed."),
        "unsubscribe": _frame(
            "Stop following a scope (the same keys as its subscribe)",
            {"action": {"const": "unsubscribe"}, **SCOPE_KEYS}, ["action"], strict=False, oneOf=_scope_choice({})),
        "ping": _frame("Ask for the relay's cursor", {"action": {"const": "ping"}}, ["action"], strict=False),
    }


def _server_frames() -> dict[str, dict]:
    cursor = {**nullable(INTEGER), "description": "the newest event id the process's relay has read"}
    scope = {"enum": [*SCOPE_KEYS]}
    scope_id = {"oneOf": [ID, {"const": True}], "description": "the scope's id (`true` for `all`)"}
    return {
        "hello": _frame("Authenticated (sent again, without `cursor`, for a repeated `auth`)",
                        {"type": {"const": "hello"}, "user": STRING, "cursor": cursor}, ["type", "user"]),
        "subscribed": _frame("The subscription is registered; the replay (if `after` was given) follows",
                             {"type": {"const": "subscribed"}, "scope": scope, "id": scope_id, "cursor": cursor},
                             ["type", "scope", "id", "cursor"]),
        "unsubscribed": _frame("The subscription is gone",
                               {"type": {"const": "unsubscribed"}, "scope": scope, "id": ANY},
                               ["type", "scope", "id"]),
        "pong": _frame("The answer to `ping`", {"type": {"const": "pong"}, "cursor": cursor}, ["type", "cursor"]),
        "error": _frame(
            "A message was refused; the connection stays open",
            {"type": {"const": "error"},
             "code": {"enum": ["bad_message", "too_many_subscriptions", "forbidden"],
                      "description": "`bad_message`: not a JSON object, unknown action, no scope, or `after` not an "
                                     "event id; `too_many_subscriptions`; `forbidden`: no such object among the "
                                     "user's organizations (or `all` without `core.view_event`)"},
             "detail": STRING, "scope": scope},
            ["type", "code", "detail"]),
    }


DESCRIPTION = """\
Live events of the Orchestrator Console. Every state change writes an event row in its own
transaction (the outbox); each server process relays committed rows, in id order, to the
WebSocket clients subscribed to their run, project or organization.

Authenticate with the session cookie, or send `auth` with an API token as the first message
(never in the URL); a socket still unauthenticated after 10 s, or one sending anything else
first, or a wrong token, is closed with code **4401**. Then `subscribe` (optionally with
`after`: the events after that id are replayed from the database before the stream goes
live). A connection's stream is in id order, each event once, across replays, several
subscriptions and catch-ups after a slow client fell behind.

Each event is one JSON object: the envelope (`id`, `type`, `ts`, `organization`, `project`,
`run`) and the keys of its type's payload.
"""


@lru_cache(maxsize=1)
def asyncapi_document() -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document (built once per process)."""
    from django.conf import settings

    messages: dict[str, dict] = {}
    schemas: dict[str, dict] = {}
    received = _client_messages()
    sent = _server_frames()
    messages.update({name: {"name": name, **body} for name, body in {**received, **sent}.items()})
    events = event_types()
    for event_type, message in events.items():
        schemas.update(message.schemas)
        body = {"name": event_type, "title": event_type, "summary": message.summary,
                "payload": _event_payload(event_type, message)}
        if message.family:
            body["tags"] = [{"name": message.family}]
        messages[event_type] = body
    channel_messages = {name: {"$ref": f"#/components/messages/{name}"} for name in messages}

    def operation(action: str, names, summary: str) -> dict:
        return {"action": action, "summary": summary, "channel": {"$ref": f"#/channels/{CHANNEL}"},
                "messages": [{"$ref": f"#/channels/{CHANNEL}/messages/{name}"} for name in names]}

    return {
        "asyncapi": ASYNCAPI_VERSION,
        "id": "urn:orchestrator-console:events",
        "info": {"title": "Orchestrator Console live events", "version": settings.SPECTACULAR_SETTINGS.get(
            "VERSION", "1.0.0") or "1.0.0", "description": DESCRIPTION},
        "defaultContentType": "application/json",
        "servers": {"console": {"host": "localhost:8000", "protocol": "ws",
                                "description": "the console's ASGI server (wss behind TLS)"}},
        "channels": {CHANNEL: {
            "address": ADDRESS, "title": "Events",
            "description": "One WebSocket connection: client actions in, events and frames out.",
            "messages": channel_messages,
            "bindings": {"ws": {"method": "GET", "bindingVersion": "0.1.0"}},
        }},
        "operations": {
            "receiveClientActions": operation("receive", list(received),
                                              "The console receives auth, subscribe, unsubscribe and ping."),
            "sendFrames": operation("send", list(sent), "The console answers with protocol frames."),
            "sendEvents": operation("send", list(events),
                                    "The console sends the committed events of the subscribed scopes."),
        },
        "components": {"messages": messages, "schemas": schemas},
    }


def asyncapi_yaml() -> str:
    return yaml.safe_dump(asyncapi_document(), sort_keys=False, allow_unicode=True, width=110)


class AsyncAPIView(APIView):
    """``GET /api/asyncapi.yaml`` (YAML) and ``GET /api/schema/asyncapi/`` (JSON): public, like
    the OpenAPI schema; other methods get the API's JSON 405."""

    permission_classes = [AllowAny]
    authentication_classes: list = []
    schema = None  # not an operation of the OpenAPI document
    as_json = False

    def get(self, request):
        if self.as_json:
            return HttpResponse(json.dumps(asyncapi_document(), indent=1), content_type="application/json")
        return HttpResponse(asyncapi_yaml(), content_type="application/yaml; charset=utf-8")
