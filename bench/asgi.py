"""The site's ASGI application plus bench/events.py's bare-Channels baseline at ``/ws/bench/``.

Served only by the benchmark (``daphne bench.asgi:application``); production routing
(``orchestrator_site.asgi``) imports nothing from ``bench``.
"""

from django.urls import path

from bench.channels_baseline import BenchConsumer
from orchestrator_site import asgi as site

websocket_routes = [*site.websocket_routes, path("ws/bench/", BenchConsumer.as_asgi())]
application = site.application_for(websocket_routes)
