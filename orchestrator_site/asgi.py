"""ASGI entry point served by daphne: HTTP (admin, API) and WebSocket (``/ws/events/``)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "orchestrator_site.settings")

django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs the app registry)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.urls import path  # noqa: E402

from core.consumers import EventConsumer  # noqa: E402

websocket_routes = [path("ws/events/", EventConsumer.as_asgi())]


def application_for(routes: list) -> ProtocolTypeRouter:
    """The site's protocol router over these WebSocket routes (HTTP is Django's)."""
    return ProtocolTypeRouter({
        "http": django_asgi_app,
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(routes))),
    })


application = application_for(websocket_routes)
