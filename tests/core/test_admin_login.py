"""The admin login is limited per username and per address on failed attempts: past a limit the
form asks to wait and checks no password."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

pytestmark = pytest.mark.django_db
LOGIN = "/admin/login/?next=/admin/"
START = 1_800_000_000


@pytest.fixture
def clock(monkeypatch):
    now = {"t": START + 1.0}
    monkeypatch.setattr("core.ratelimit.time.time", lambda: now["t"])
    return now


@pytest.fixture
def password_checks(monkeypatch):
    """How many times the login form asked the authentication backends."""
    import django.contrib.auth.forms as forms

    calls = {"n": 0}
    real = forms.authenticate

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(forms, "authenticate", counting)
    return calls


@pytest.fixture
def alice():
    return get_user_model().objects.create_user(username="alice", password="right-password", is_staff=True)


def login(address: str, username: str, password: str):
    return Client(REMOTE_ADDR=address).post(LOGIN, {"username": username, "password": password})


def refused(response) -> bool:
    return response.status_code == 200 and "Too many failed login attempts" in response.content.decode()


def test_failures_for_a_username_from_many_addresses_lock_that_username(settings, clock, alice, password_checks):
    settings.ORCHESTRATOR_LOGIN_USERNAME_FAILURES = "3/15m"
    settings.ORCHESTRATOR_LOGIN_ADDRESS_FAILURES = "100/15m"
    get_user_model().objects.create_user(username="bob", password="bobs-password", is_staff=True)
    for attempt in range(3):
        response = login(f"203.0.113.{attempt}", "alice", f"guess-{attempt}")
        assert response.status_code == 200 and not refused(response)  # the usual wrong-password form
    checks = password_checks["n"]
    response = login("198.51.100.50", "Alice", "right-password")  # a fresh address, the right password
    # Wait until the failures (in the bucket [+0, +90 s)) leave the 15-minute window: 989 s.
    assert refused(response) and "Try again in 17 minutes" in response.content.decode()
    assert password_checks["n"] == checks  # no password was checked
    assert "_auth_user_id" not in response.wsgi_request.session
    assert login("203.0.113.0", "bob", "bobs-password").status_code == 302  # other usernames are not locked
    clock["t"] = START + 1 + 15 * 60 + 90  # the failures have left the window (and its last bucket)
    assert login("198.51.100.50", "alice", "right-password").status_code == 302


def test_failures_from_an_address_for_many_usernames_lock_that_address(settings, clock, alice, password_checks):
    settings.ORCHESTRATOR_LOGIN_USERNAME_FAILURES = "100/15m"
    settings.ORCHESTRATOR_LOGIN_ADDRESS_FAILURES = "3/15m"
    for name in ("root", "admin", "operator"):
        assert not refused(login("203.0.113.9", name, "password"))
    checks = password_checks["n"]
    assert refused(login("203.0.113.9", "alice", "right-password"))
    assert password_checks["n"] == checks
    assert login("198.51.100.7", "alice", "right-password").status_code == 302  # another address


def test_a_forged_forwarded_for_header_does_not_escape_the_address_limit(settings, clock, alice):
    settings.ORCHESTRATOR_LOGIN_ADDRESS_FAILURES = "2/15m"
    for n in range(2):
        Client(REMOTE_ADDR="203.0.113.9", HTTP_X_FORWARDED_FOR=f"10.0.0.{n}").post(
            LOGIN, {"username": f"user{n}", "password": "x"})
    forged = Client(REMOTE_ADDR="203.0.113.9", HTTP_X_FORWARDED_FOR="10.9.9.9")
    assert refused(forged.post(LOGIN, {"username": "alice", "password": "right-password"}))


def test_successful_logins_are_not_counted(settings, clock, alice):
    settings.ORCHESTRATOR_LOGIN_USERNAME_FAILURES = "2/15m"
    settings.ORCHESTRATOR_LOGIN_ADDRESS_FAILURES = "2/15m"
    for _ in range(4):
        assert login("203.0.113.9", "alice", "right-password").status_code == 302
