"""WebSocket clients of ``/ws/events/`` that reconnect and replay, as a well-behaved client does.

Each client authenticates with an API token, subscribes to one scope (``{"project": 3}``,
``{"run": 12}`` ...) with ``after`` = the last event id it received, and records every event.
When its socket drops it reconnects to the next daphne process in its list and subscribes
again with ``after``, so the server replays what it missed. All clients live on one event loop
in a background thread; ``drop_all`` resets every socket in one loop callback (at once).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field


@dataclass(eq=False)
class EventClient:
    index: int
    urls: list[str]
    subscription: dict
    after: int
    events: list[dict] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    connects: int = 0
    unexpected_closes: int = 0
    url_index: int = 0
    dropping: bool = False
    socket: object = field(default=None, repr=False)
    subscribed: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def last_id(self) -> int:
        return self.events[-1]["id"] if self.events else self.after

    def ids(self) -> list[int]:
        return [event["id"] for event in self.events]


class EventClients:
    """``len(subscriptions)`` clients spread over ``urls`` (client i starts on ``urls[i % len]``)."""

    def __init__(self, urls: list[str], token: str, subscriptions: list[dict], *, after: int,
                 origin: str = "http://localhost", drop_pause_s: float = 1.0):
        self.token = token
        self.origin = origin
        self.drop_pause_s = drop_pause_s
        self.clients = [EventClient(index=i, urls=list(urls), subscription=dict(sub), after=after,
                                    url_index=i % len(urls)) for i, sub in enumerate(subscriptions)]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="event-clients", daemon=True)
        self.tasks: list[asyncio.Task] = []
        self.stopping = False

    # --- control (from any thread) ------------------------------------------------------------
    def start(self, timeout: float = 60) -> "EventClients":
        self.thread.start()
        for client in self.clients:
            asyncio.run_coroutine_threadsafe(self._spawn(client), self.loop).result(5)
        self.wait_subscribed(timeout)
        return self

    def wait_subscribed(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for client in self.clients:
            if not client.subscribed.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"client {client.index} did not subscribe within {timeout:g}s: {client.errors[-3:]}")

    def drop_all(self) -> int:
        """Reset every connected socket at once (TCP RST); each client then reconnects and replays."""
        done = threading.Event()
        dropped = []

        def drop():
            for client in self.clients:
                ws = client.socket
                if ws is None:
                    continue
                client.dropping = True
                client.subscribed.clear()
                sock = ws.transport.get_extra_info("socket")
                if sock is not None:  # linger 0: the peer sees a reset, not a goodbye
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                ws.transport.abort()
                dropped.append(client.index)
            done.set()

        self.loop.call_soon_threadsafe(drop)
        done.wait(10)
        return len(dropped)

    def caught_up(self, targets: dict[int, int]) -> bool:
        """True when every client ``i`` received events up to id ``targets[i]``."""
        return all(self.clients[i].last_id >= target for i, target in targets.items())

    def stop(self) -> None:
        self.stopping = True

        async def close_all():
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            for client in self.clients:
                if client.socket is not None:
                    client.socket.transport.abort()

        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(close_all(), self.loop).result(15)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    # --- the loop ---------------------------------------------------------------------------
    async def _spawn(self, client: EventClient) -> None:
        self.tasks.append(self.loop.create_task(self._life(client)))

    async def _life(self, client: EventClient) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import WebSocketException

        while not self.stopping:
            url = client.urls[client.url_index]
            try:
                async with connect(url, origin=self.origin, open_timeout=15, ping_interval=None,
                                   max_size=None, max_queue=None, close_timeout=2) as ws:
                    client.socket = ws
                    await ws.send(json.dumps({"action": "auth", "token": self.token}))
                    await self._until(client, ws, "hello")
                    await ws.send(json.dumps({"action": "subscribe", **client.subscription, "after": client.last_id}))
                    await self._until(client, ws, "subscribed")
                    client.connects += 1
                    client.subscribed.set()
                    async for raw in ws:
                        self._handle(client, raw)
            except asyncio.CancelledError:
                raise
            except (WebSocketException, OSError, TimeoutError, asyncio.TimeoutError) as exc:
                if not client.dropping:
                    client.errors.append(f"{url}: {type(exc).__name__}: {exc}")
            finally:
                client.socket = None
            if self.stopping:
                return
            if client.dropping:
                client.dropping = False
                await asyncio.sleep(self.drop_pause_s)
            else:
                client.unexpected_closes += 1
                client.subscribed.clear()
                await asyncio.sleep(0.5)
            client.url_index = (client.url_index + 1) % len(client.urls)

    async def _until(self, client: EventClient, ws, message_type: str) -> None:
        while True:
            raw = await asyncio.wait_for(ws.recv(), timeout=30)
            message = self._handle(client, raw)
            if message.get("type") == message_type and "ts" not in message:
                return
            if message.get("type") == "error":
                raise ConnectionError(f"server refused: {message}")

    @staticmethod
    def _handle(client: EventClient, raw) -> dict:
        message = json.loads(raw)
        if "ts" in message and "id" in message:  # an event envelope
            client.events.append({"id": message["id"], "type": message["type"], "run": message.get("run")})
        elif message.get("type") == "error":
            client.errors.append(json.dumps(message))
        return message
