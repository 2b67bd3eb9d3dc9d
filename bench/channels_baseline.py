"""A bare Channels consumer for bench/events.py's baseline (routed only by ``bench.asgi``).

Clients connect to ``/ws/bench/`` and join the group ``bench``; a client sending
``{"fire": n, "rate": r}`` makes this process ``group_send`` n messages at r per second, each
stamped with its send time, through the configured channel layer.
"""

import asyncio
import time

from channels.generic.websocket import AsyncJsonWebsocketConsumer


class BenchConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        await self.channel_layer.group_add("bench", self.channel_name)
        await self.accept()

    async def disconnect(self, code):
        await self.channel_layer.group_discard("bench", self.channel_name)

    async def receive_json(self, content, **kwargs):
        # Fire from a task: this consumer also receives the group's messages, one at a time.
        count, rate = int(content.get("fire", 0)), float(content.get("rate", 20))
        self.firing = asyncio.get_running_loop().create_task(self._fire(count, rate))

    async def _fire(self, count: int, rate: float):
        for index in range(count):
            await self.channel_layer.group_send("bench", {"type": "bench.message", "n": index, "ts": time.time()})
            await asyncio.sleep(1 / rate)

    async def bench_message(self, message):
        await self.send_json({"n": message["n"], "ts": message["ts"]})
