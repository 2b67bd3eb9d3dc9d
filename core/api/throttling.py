"""Request rate limits of the API (``429 rate_limited`` with ``Retry-After``).

Per principal in a sliding window, counted atomically (``core.ratelimit``): an authenticated
caller (API token or session) is ``user:<id>`` and gets ``ORCHESTRATOR_API_RATE``; a caller
without valid credentials is ``ip:<address>`` and gets ``ORCHESTRATOR_API_ANON_RATE`` (empty:
the same rate). Requests that fail authentication count too, so guessing tokens is limited
like anything else. Defaults: 1200/minute per caller, 120/minute per address; an empty
``ORCHESTRATOR_API_RATE``: no limit. ``health/`` is never limited.
"""

from __future__ import annotations

from django.conf import settings
from rest_framework import exceptions, throttling

from core.ratelimit import rate_limit_hit, rate_parse


class RateLimitThrottle(throttling.BaseThrottle):
    """DRF throttle over ``core.ratelimit``; rates are read from settings on every request."""

    def __init__(self) -> None:
        self.retry_after_s: int | None = None

    def principal(self, request) -> tuple[str, str]:
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            return f"user:{user.pk}", settings.ORCHESTRATOR_API_RATE
        return f"ip:{self.get_ident(request)}", settings.ORCHESTRATOR_API_ANON_RATE or settings.ORCHESTRATOR_API_RATE

    def allow_request(self, request, view) -> bool:
        key, text = self.principal(request)
        rate = rate_parse(text)
        if rate is None:
            return True
        decision = rate_limit_hit(key, rate)
        self.retry_after_s = decision.retry_after_s
        return decision.allowed

    def wait(self) -> float | None:
        return self.retry_after_s


# The name settings used before; kept so REST_FRAMEWORK settings elsewhere keep working.
UserRateThrottle = RateLimitThrottle


class RateLimitedViewMixin:
    """Counts requests that fail authentication too (as the caller's address).

    DRF checks credentials before throttles, so without this a flood of bad tokens would only
    ever see ``401``. Here a refused request is still counted, and answers ``429`` once its
    address is over the limit.
    """

    def initial(self, request, *args, **kwargs):
        try:
            super().initial(request, *args, **kwargs)
        except (exceptions.NotAuthenticated, exceptions.AuthenticationFailed):
            self.check_throttles(request)
            raise
