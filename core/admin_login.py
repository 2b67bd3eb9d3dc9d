"""The admin's login form, limited per username and per address on failed attempts.

Past ``ORCHESTRATOR_LOGIN_USERNAME_FAILURES`` failures for a username (from any address) or
``ORCHESTRATOR_LOGIN_ADDRESS_FAILURES`` from an address (for any usernames) within their
period, the form says how long to wait and checks no password. Failures are counted in the
rate-limit store (``core.ratelimit``), so every web process sees the same counts.
"""

from __future__ import annotations

import hashlib

from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.core.exceptions import ValidationError

from core.ratelimit import client_address, rate_limit_hit, rate_limit_peek, rate_parse, retry_after_text


def _login_limits(request, username: str) -> list[tuple[str, object]]:
    """(key, rate) of the username's and the address's failure counts (the limits that are set)."""
    # Usernames are the client's input: hashed (bounded, not stored), case-folded (one count for
    # "Operator" and "operator").
    digest = hashlib.sha256(username.strip().casefold().encode()).hexdigest()
    limits = [(f"login-user:{digest}", rate_parse(settings.ORCHESTRATOR_LOGIN_USERNAME_FAILURES)),
              (f"login-ip:{client_address(request.META)}", rate_parse(settings.ORCHESTRATOR_LOGIN_ADDRESS_FAILURES))]
    return [(key, rate) for key, rate in limits if rate is not None]


class RateLimitedAdminLoginForm(AdminAuthenticationForm):
    """The admin login form; refuses without checking the password once failures pass a limit."""

    error_messages = {
        **AdminAuthenticationForm.error_messages,
        "rate_limited": "Too many failed login attempts for this username or from this address. "
                        "Try again in %(wait)s.",
    }

    def clean(self):
        username = self.cleaned_data.get("username")
        if self.request is None or not username or not self.cleaned_data.get("password"):
            return super().clean()
        limits = _login_limits(self.request, username)
        waits = [decision.retry_after_s for decision in (rate_limit_peek(key, rate) for key, rate in limits)
                 if not decision.allowed]
        if waits:
            raise ValidationError(self.error_messages["rate_limited"], code="rate_limited",
                                  params={"wait": retry_after_text(max(waits))})
        try:
            return super().clean()
        except ValidationError:
            for key, rate in limits:
                rate_limit_hit(key, rate)
            raise
