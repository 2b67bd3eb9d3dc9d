"""Abuse limits: per-caller request rates (atomic store), body size limits, WebSocket subscriptions."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
from channels.testing import WebsocketCommunicator
from django.db import connection
from rest_framework.test import APIClient

from core.models import RateLimitCounter
from core.ratelimit import ANCHOR, DatabaseStore, Rate, RedisStore, rate_limit_hit, rate_limit_peek, rate_parse
from jobs.models import Job
from runs.models import Run
from tests.api.conftest import assert_error
from tests.processes import REDIS_TEST_URL, redis_available

pytestmark = pytest.mark.django_db
WINDOW_START = 1_800_000_000  # a minute boundary: tests move the clock within one window, then past it


@pytest.fixture
def clock(monkeypatch):
    """The rate limiter's clock, set by the test."""
    now = {"t": WINDOW_START + 5.0}
    monkeypatch.setattr("core.ratelimit.time.time", lambda: now["t"])
    return now


# --- rates ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [("600/minute", Rate(600, 60)), ("20/s", Rate(20, 1)),
                                            ("1000/5m", Rate(1000, 300)), ("5/hours", Rate(5, 3600)),
                                            ("", None), (None, None)])
def test_rates_parse(text, expected):
    assert rate_parse(text) == expected


@pytest.mark.parametrize("text", ["600", "x/minute", "0/minute", "5/fortnight"])
def test_bad_rates_are_refused_loudly(text):
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured):
        rate_parse(text)


def test_over_the_limit_is_429_rate_limited_with_retry_after(tenant, settings, clock):
    settings.ORCHESTRATOR_API_RATE = "3/minute"
    for _ in range(3):
        assert tenant.client.get("/api/v1/ping/").status_code == 200
    response = tenant.client.get("/api/v1/ping/")
    body = assert_error(response, 429, "rate_limited")
    # The three requests sit in the bucket [+0, +6) s, counted until the window no longer
    # reaches into it: +66 s.
    assert response["Retry-After"] == "61" and body["retry_after"] == 61
    assert_error(tenant.client.get("/api/v1/runs/"), 429, "rate_limited")  # every endpoint shares the count
    clock["t"] = WINDOW_START + 60.5  # the next fixed minute: still within a minute of the three
    assert_error(tenant.client.get("/api/v1/ping/"), 429, "rate_limited")
    clock["t"] = WINDOW_START + 66
    assert tenant.client.get("/api/v1/ping/").status_code == 200


def test_each_caller_has_its_own_count(tenant, other, settings, clock):
    settings.ORCHESTRATOR_API_RATE = "2/minute"
    for _ in range(2):
        assert tenant.client.get("/api/v1/ping/").status_code == 200
    assert_error(tenant.client.get("/api/v1/ping/"), 429, "rate_limited")
    assert other.client.get("/api/v1/ping/").status_code == 200
    session = APIClient()
    session.force_login(other.user)  # the same user by session: the same caller as its token
    assert session.get("/api/v1/ping/").status_code == 200
    assert_error(other.client.get("/api/v1/ping/"), 429, "rate_limited")


def test_failed_authentication_counts_per_address(db, settings, clock):
    settings.ORCHESTRATOR_API_RATE = "100/minute"
    settings.ORCHESTRATOR_API_ANON_RATE = "3/minute"
    guesser = APIClient(REMOTE_ADDR="203.0.113.9")
    for attempt in range(3):
        guesser.credentials(HTTP_AUTHORIZATION=f"Token guess{attempt}")
        assert_error(guesser.get("/api/v1/ping/"), 401, "authentication_failed")
    guesser.credentials(HTTP_AUTHORIZATION="Token guess-again")
    assert_error(guesser.get("/api/v1/ping/"), 429, "rate_limited")
    assert_error(APIClient(REMOTE_ADDR="203.0.113.9").get("/api/v1/runs/"), 429, "rate_limited")
    assert_error(APIClient(REMOTE_ADDR="198.51.100.7").get("/api/v1/runs/"), 401, "not_authenticated")


def test_a_forged_forwarded_for_header_does_not_escape_the_address_limit(db, settings, clock):
    settings.ORCHESTRATOR_API_ANON_RATE = "2/minute"
    for n in range(2):
        client = APIClient(REMOTE_ADDR="203.0.113.9", HTTP_X_FORWARDED_FOR=f"10.0.0.{n}")
        assert_error(client.get("/api/v1/runs/"), 401, "not_authenticated")
    forged = APIClient(REMOTE_ADDR="203.0.113.9", HTTP_X_FORWARDED_FOR="10.9.9.9")
    assert_error(forged.get("/api/v1/runs/"), 429, "rate_limited")


def test_behind_a_trusted_proxy_the_address_it_forwarded_counts(db, settings, clock):
    settings.ORCHESTRATOR_API_ANON_RATE = "1/minute"
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "NUM_PROXIES": 1}
    proxy = "192.0.2.1"
    first = APIClient(REMOTE_ADDR=proxy, HTTP_X_FORWARDED_FOR="10.9.9.9, 198.51.100.7")
    assert_error(first.get("/api/v1/runs/"), 401, "not_authenticated")
    # a client's own prefix does not change the address the proxy saw
    again = APIClient(REMOTE_ADDR=proxy, HTTP_X_FORWARDED_FOR="10.1.1.1, 198.51.100.7")
    assert_error(again.get("/api/v1/runs/"), 429, "rate_limited")
    other = APIClient(REMOTE_ADDR=proxy, HTTP_X_FORWARDED_FOR="198.51.100.8")
    assert_error(other.get("/api/v1/runs/"), 401, "not_authenticated")


def test_no_rate_means_no_counting(tenant, settings):
    settings.ORCHESTRATOR_API_RATE = ""
    for _ in range(5):
        assert tenant.client.get("/api/v1/ping/").status_code == 200
    assert not RateLimitCounter.objects.exists()


def test_health_is_never_limited(db, settings, clock):
    settings.ORCHESTRATOR_API_RATE = "1/minute"
    client = APIClient()
    assert {client.get("/api/v1/health/").status_code for _ in range(3)} <= {200, 503}


def test_the_database_store_keeps_one_row_per_bucket_and_records_only_admitted_requests(db):
    rate = Rate(3, 60)
    hits = [rate_limit_hit("user:1", rate, now=WINDOW_START + offset, store=DatabaseStore()).allowed
            for offset in (1, 2, 7, 8)]
    assert hits == [True, True, True, False]
    assert rate_limit_hit("user:2", rate, now=WINDOW_START + 8, store=DatabaseStore()).allowed
    buckets = sorted((key, start.timestamp() - WINDOW_START, count) for key, start, count in
                     RateLimitCounter.objects.exclude(window_start=ANCHOR).values_list("key", "window_start", "count"))
    assert buckets == [("user:1", 0, 2), ("user:1", 6, 1), ("user:2", 6, 1)]


@pytest.mark.parametrize("store_kind", ["database", "redis"])
def test_peek_says_whether_a_request_would_pass_and_records_nothing(db, settings, store_kind):
    store = _store(settings, store_kind)
    key, rate = f"ip:{uuid.uuid4().hex}", Rate(2, 60)
    assert rate_limit_peek(key, rate, now=WINDOW_START + 1, store=store).allowed
    assert rate_limit_peek(key, rate, now=WINDOW_START + 1, store=store).count == 0
    for _ in range(2):
        assert rate_limit_hit(key, rate, now=WINDOW_START + 1, store=store).allowed
    refused = rate_limit_peek(key, rate, now=WINDOW_START + 30, store=store)
    assert (refused.allowed, refused.count, refused.retry_after_s) == (False, 2, 36)  # bucket [0, 6) leaves at +66
    assert rate_limit_peek(key, rate, now=WINDOW_START + 66, store=store).allowed


def _store(settings, kind: str):
    if kind == "database":
        return DatabaseStore()
    if not redis_available():
        pytest.skip("needs Redis (REDIS_TEST_URL)")
    settings.REDIS_URL = REDIS_TEST_URL
    return RedisStore()


def _most_in_any_window(admitted: list[float], period_s: float) -> int:
    """The most admitted requests in any closed window ``[t - period, t]``."""
    admitted = sorted(admitted)
    most, first = 0, 0
    for last, at in enumerate(admitted):
        while admitted[first] < at - period_s:
            first += 1
        most = max(most, last - first + 1)
    return most


@pytest.mark.parametrize("store_kind", ["database", "redis"])
def test_a_burst_straddling_a_window_boundary_gets_no_more_than_the_limit(db, settings, store_kind):
    """600 requests in the two seconds around a minute boundary against 300/minute (a fixed
    window let 300 + 108 of them through), then a steady 4 requests/s for two and a half minutes."""
    store = _store(settings, store_kind)
    key, rate = f"user:{uuid.uuid4().hex}", Rate(300, 60)
    boundary = WINDOW_START + 60
    times = [boundary - 1 + index * (2 / 600) for index in range(600)]
    times += [boundary + 1 + index * 0.25 for index in range(600)]
    admitted = [at for at in times if rate_limit_hit(key, rate, now=at, store=store).allowed]
    assert _most_in_any_window(admitted, 60) == 300
    assert sum(1 for at in admitted if at < boundary + 1) == 300  # the burst: one minute's allowance
    # The 300 admitted all fell into the bucket [boundary - 6 s, boundary): nothing more passes
    # until it leaves the window, a minute later; then the steady 4/s (under the rate) all passes.
    assert all(at < boundary or at >= boundary + 60 for at in admitted)
    assert admitted[300:] == [at for at in times[600:] if at >= boundary + 60]


@pytest.mark.parametrize("store_kind", ["database", "redis"])
def test_random_traffic_never_gets_more_than_the_limit_in_any_window(db, settings, store_kind):
    import random

    store = _store(settings, store_kind)
    generator = random.Random(20240601)
    key, rate = f"user:{uuid.uuid4().hex}", Rate(20, 10)
    at, times = WINDOW_START + 3.3, []
    while len(times) < 600:  # bursts and lulls over about two minutes
        at += generator.choice([0.001, 0.01, 0.05, 0.2, 1.0, 3.7])
        times.append(at)
    decisions = [(at, rate_limit_hit(key, rate, now=at, store=store).allowed) for at in times]
    admitted = [at for at, allowed in decisions if allowed]
    assert _most_in_any_window(admitted, 10) == 20
    # No needless refusal: a refused request had the limit admitted within the period and one
    # bucket (a tenth of it) before it.
    refused = [at for at, allowed in decisions if not allowed]
    assert refused and all(sum(1 for seen in admitted if at - 11 <= seen <= at) >= 20 for at in refused)


def _hammer(increment, threads: int, per_thread: int) -> list[bool]:
    barrier = threading.Barrier(threads)
    results: list[bool] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work():
        try:
            barrier.wait()
            for _ in range(per_thread):
                allowed = increment()
                with lock:
                    results.append(allowed)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            connection.close()

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert not errors, errors
    return results


@pytest.mark.django_db(transaction=True)
def test_concurrent_requests_never_slip_past_the_limit_database():
    rate = Rate(25, 3600)
    key = f"user:{uuid.uuid4().hex}"
    results = _hammer(lambda: rate_limit_hit(key, rate, now=WINDOW_START + 1, store=DatabaseStore()).allowed,
                      threads=8, per_thread=10)
    assert results.count(True) == 25 and len(results) == 80
    assert RateLimitCounter.objects.exclude(window_start=ANCHOR).get(key=key).count == 25  # only admitted ones


@pytest.mark.skipif(not redis_available(), reason="needs Redis (REDIS_TEST_URL)")
def test_concurrent_requests_never_slip_past_the_limit_redis(settings):
    settings.REDIS_URL = REDIS_TEST_URL
    rate = Rate(25, 3600)
    key = f"user:{uuid.uuid4().hex}"
    store = RedisStore()
    results = _hammer(lambda: rate_limit_hit(key, rate, now=WINDOW_START + 1, store=store).allowed,
                      threads=8, per_thread=10)
    assert results.count(True) == 25 and len(results) == 80
    name = RedisStore.name(key)
    client = store.client()
    assert sum(int(count) for count in client.hgetall(name).values()) == 25
    assert 0 < client.ttl(name) <= 2 * 3600  # the buckets expire on their own
    client.delete(name)


# --- body size ------------------------------------------------------------------------------

def test_a_plan_over_the_body_limit_is_413_and_creates_nothing(tenant, settings):
    settings.ORCHESTRATOR_API_MAX_BODY_BYTES = 2_000
    plan = {"agents": [{"name": "a", "tasks": [{"name": "t", "steps": [
        {"name": f"s{i}", "tool": "echo", "args": {"text": "x" * 50}} for i in range(40)]}]}]}
    body = assert_error(tenant.client.post("/api/v1/runs/", tenant.run_body(plan=plan), format="json"), 413,
                        "payload_too_large")
    assert "2000 bytes" in body["detail"]
    assert not Run.objects.exists()
    # With an Idempotency-Key the body is read (and hashed) before it is parsed: still a 413.
    assert_error(tenant.client.post("/api/v1/runs/", tenant.run_body(plan=plan), format="json",
                                    HTTP_IDEMPOTENCY_KEY="big"), 413, "payload_too_large")
    assert tenant.client.post("/api/v1/runs/", tenant.run_body(), format="json").status_code == 201


def test_a_job_payload_over_the_body_limit_is_413(tenant, settings):
    settings.ORCHESTRATOR_API_MAX_BODY_BYTES = 1_000
    response = tenant.client.post("/api/v1/jobs/", {"type": "noop", "project": tenant.project.pk,
                                                    "payload": {"value": "y" * 2_000}}, format="json")
    assert_error(response, 413, "payload_too_large")
    assert not Job.objects.exists()


def test_djangos_own_upload_limit_is_413_not_500(tenant, settings):
    """``DATA_UPLOAD_MAX_MEMORY_SIZE`` raises ``RequestDataTooBig`` where the raw body is read."""
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 500
    response = tenant.client.post("/api/v1/runs/", tenant.run_body(name="n" * 1_000), format="json",
                                  HTTP_IDEMPOTENCY_KEY="raw-body")
    body = assert_error(response, 413, "payload_too_large")
    assert "DATA_UPLOAD_MAX_MEMORY_SIZE" in body["detail"]


def test_a_body_without_a_declared_length_is_limited_too(tenant, settings):
    from core.api.parsers import LimitedJSONParser, PayloadTooLarge
    import io

    settings.ORCHESTRATOR_API_MAX_BODY_BYTES = 100
    parser = LimitedJSONParser()
    assert parser.parse(io.BytesIO(b'{"a": 1}'), parser_context={}) == {"a": 1}
    with pytest.raises(PayloadTooLarge):
        parser.parse(io.BytesIO(b'{"a": "' + b"z" * 200 + b'"}'), parser_context={})


def test_json_nested_too_deeply_is_400_not_500(tenant):
    body = "[" * 100_000 + "]" * 100_000
    assert_error(tenant.client.post("/api/v1/runs/", body, content_type="application/json"), 400,
                 "json_too_deep")


# --- WebSocket subscriptions --------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_a_socket_may_hold_only_so_many_subscriptions(tenant, settings):
    from orchestrator_site.asgi import application

    settings.ORCHESTRATOR_WS_MAX_SUBSCRIPTIONS = 2
    runs = [tenant.client.post("/api/v1/runs/", tenant.run_body(name=f"r{i}"), format="json").json()["id"]
            for i in range(3)]

    async def scenario():
        communicator = WebsocketCommunicator(application, "/ws/events/", headers=[(b"origin", b"http://localhost")])
        connected, _ = await communicator.connect()
        assert connected
        await communicator.send_json_to({"action": "auth", "token": tenant.token})
        assert (await communicator.receive_json_from(timeout=5))["type"] == "hello"
        for run_id in runs[:2]:
            await communicator.send_json_to({"action": "subscribe", "run": run_id})
            assert (await communicator.receive_json_from(timeout=5))["type"] == "subscribed"
        await communicator.send_json_to({"action": "subscribe", "run": runs[2]})
        refused = await communicator.receive_json_from(timeout=5)
        assert (refused["type"], refused["code"]) == ("error", "too_many_subscriptions")
        await communicator.send_json_to({"action": "subscribe", "run": runs[1]})  # one it holds again, at the cap
        assert (await communicator.receive_json_from(timeout=5))["type"] == "subscribed"
        await communicator.send_json_to({"action": "unsubscribe", "run": runs[0]})
        assert (await communicator.receive_json_from(timeout=5))["type"] == "unsubscribed"
        await communicator.send_json_to({"action": "subscribe", "run": runs[2]})
        assert (await communicator.receive_json_from(timeout=5))["type"] == "subscribed"
        await communicator.disconnect()

    asyncio.run(scenario())


# --- failed token authentication (WebSocket, /metrics) ---------------------------------------

@pytest.mark.django_db(transaction=True)
def test_failed_websocket_token_attempts_lock_the_address_before_any_token_is_checked(tenant, settings, clock,
                                                                                    monkeypatch):
    from core import consumers
    from orchestrator_site.asgi import application

    settings.ORCHESTRATOR_API_ANON_RATE = "3/minute"
    checked: list[str] = []
    real = consumers._user_from_token
    monkeypatch.setattr(consumers, "_user_from_token", lambda key: checked.append(key) or real(key))

    async def attempt(address: str, token):
        communicator = WebsocketCommunicator(application, "/ws/events/", headers=[(b"origin", b"http://localhost")])
        communicator.scope["client"] = (address, 50000)
        connected, _ = await communicator.connect()
        assert connected
        await communicator.send_json_to({"action": "auth", "token": token})
        first = await communicator.receive_output(timeout=5)
        if first["type"] == "websocket.close":
            return first["code"], None
        message = __import__("json").loads(first["text"])
        if message["type"] == "hello":
            await communicator.disconnect()
            return "hello", message
        closed = await communicator.receive_output(timeout=5)
        return closed["code"], message

    async def scenario():
        for guess in ("guess-1", "guess-2", 12345):  # a token that is not even a string counts too
            assert (await attempt("203.0.113.9", guess))[0] == 4401
        assert len(checked) == 2
        code, message = await attempt("203.0.113.9", tenant.token)  # the right token, from that address
        assert code == 4429 and message["code"] == "rate_limited" and message["retry_after"] == 61
        assert len(checked) == 2  # refused without being checked
        assert (await attempt("198.51.100.7", tenant.token))[0] == "hello"  # another address

    asyncio.run(scenario())
    # The address's allowance is the API's: failures on one count on the other.
    assert_error(APIClient(REMOTE_ADDR="203.0.113.9").get("/api/v1/runs/"), 429, "rate_limited")
    clock["t"] = WINDOW_START + 66
    assert asyncio.run(attempt("203.0.113.9", tenant.token))[0] == "hello"


def test_failed_metrics_tokens_lock_the_address_before_any_token_is_compared(db, settings, clock, monkeypatch):
    from django.test import Client

    settings.ORCHESTRATOR_METRICS_TOKEN = "the-metrics-token"
    settings.ORCHESTRATOR_API_ANON_RATE = "3/minute"
    compared: list[str] = []
    monkeypatch.setattr("core.metrics.hmac", __import__("types").SimpleNamespace(
        compare_digest=lambda given, expected: compared.append(given) or given == expected))
    guesser = Client(REMOTE_ADDR="203.0.113.9")
    for guess in range(3):
        response = guesser.get("/metrics", HTTP_AUTHORIZATION=f"Bearer guess-{guess}")
        assert response.status_code == 401 and response.json()["code"] == "authentication_failed"
    response = guesser.get("/metrics", HTTP_AUTHORIZATION="Bearer the-metrics-token")
    assert response.status_code == 429 and response.json()["code"] == "rate_limited"
    assert response["Retry-After"] == "61" and response.json()["retry_after"] == 61
    assert len(compared) == 3  # the fourth token was never compared
    assert Client(REMOTE_ADDR="198.51.100.7").get(
        "/metrics", HTTP_AUTHORIZATION="Bearer the-metrics-token").status_code == 200
    clock["t"] = WINDOW_START + 66
    assert guesser.get("/metrics", HTTP_AUTHORIZATION="Bearer the-metrics-token").status_code == 200
