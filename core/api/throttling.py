"""Per-user request rate (``ORCHESTRATOR_API_RATE``, e.g. ``600/minute``; empty: unlimited)."""

from __future__ import annotations

from django.conf import settings
from rest_framework import throttling


class UserRateThrottle(throttling.UserRateThrottle):
    """DRF's user throttle with its rate read from settings on every request."""

    scope = "user"

    def __init__(self):  # the rate is read per request, not at start-up
        pass

    def allow_request(self, request, view):
        rate = settings.ORCHESTRATOR_API_RATE
        if not rate:
            return True
        self.rate = rate
        self.num_requests, self.duration = self.parse_rate(rate)
        return super().allow_request(request, view)
