"""``/ws/events/`` against hostile messages: an error frame each, and the connection goes on."""

from __future__ import annotations

import asyncio

import pytest
from channels.testing import WebsocketCommunicator
from rest_framework.authtoken.models import Token

from orchestrator_site.asgi import application

pytestmark = pytest.mark.django_db(transaction=True)

HOSTILE = [
    ("[" * 5_000 + "]" * 5_000, "json_too_deep"),
    ('{"action": "subscribe", "run": ' + "[" * 40 + "]" * 40 + "}", "json_too_deep"),
    ("not json", "invalid_json"),
    ('{"action": "subscribe", "run": NaN}', "invalid_json"),
    ('{"action": "subscribe", "run": 1e400}', "invalid_json"),
    ('{"action": "subscribe", "all": true, "after": -Infinity}', "invalid_json"),
    ('{"action": "\\ud800"}', "invalid_json"),
    ("9" * 5_000, "invalid_json"),
    (b"\xff\xfe binary", "bad_message"),
    ('{"action": "subscribe", "run": %d}' % 10**400, "bad_message"),
    ('{"action": "subscribe", "project": -5}', "bad_message"),
    ('{"action": "subscribe", "organization": "1"}', "bad_message"),
    ('{"action": "subscribe", "run": 1, "after": %d}' % 2**63, "bad_message"),
]


def test_every_hostile_message_gets_an_error_frame_and_the_connection_goes_on(org_factory):
    _, _, owner = org_factory()
    token = Token.objects.create(user=owner).key

    async def scenario():
        communicator = WebsocketCommunicator(application, "/ws/events/", headers=[(b"origin", b"http://localhost")])
        connected, _ = await communicator.connect()
        assert connected
        await communicator.send_json_to({"action": "auth", "token": token})
        assert (await communicator.receive_json_from(timeout=5))["type"] == "hello"
        for message, code in HOSTILE:
            if isinstance(message, bytes):
                await communicator.send_to(bytes_data=message)
            else:
                await communicator.send_to(text_data=message)
            error = await communicator.receive_json_from(timeout=5)
            assert (error["type"], error["code"]) == ("error", code), (message[:60], error)
            assert error["detail"]
            if code == "json_too_deep":
                assert error["max_depth"] == 32
            await communicator.send_json_to({"action": "ping"})
            assert (await communicator.receive_json_from(timeout=5))["type"] == "pong"
        await communicator.disconnect()

    asyncio.run(scenario())


def test_a_hostile_message_before_authentication_closes_the_socket_with_4401():
    async def scenario():
        communicator = WebsocketCommunicator(application, "/ws/events/", headers=[(b"origin", b"http://localhost")])
        connected, _ = await communicator.connect()
        assert connected
        await communicator.send_to(text_data="[" * 5_000 + "]" * 5_000)
        error = await communicator.receive_json_from(timeout=5)
        assert (error["type"], error["code"]) == ("error", "json_too_deep")
        assert (await communicator.receive_output(timeout=5)) == {"type": "websocket.close", "code": 4401}

    asyncio.run(scenario())
