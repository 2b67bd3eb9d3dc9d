"""Authentication (token, session with CSRF) and the one error shape for DRF's own errors."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from runs.models import Run
from tests.api.conftest import assert_error, token_client

pytestmark = pytest.mark.django_db

CSRF_SECRET = "abcdefghijklmnopqrstuvwxyzABCDEF"


def test_no_credentials_is_401_with_a_token_challenge():
    response = APIClient().get("/api/v1/runs/")
    assert_error(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"] == "Token"


def test_a_wrong_token_is_401(tenant):
    assert_error(token_client("0" * 40).get("/api/v1/runs/"), 401, "authentication_failed")
    tenant.user.is_active = False
    tenant.user.save()
    assert_error(tenant.client.get("/api/v1/runs/"), 401, "authentication_failed")


def test_drf_create_token_issues_a_working_token(tenant):
    Token.objects.filter(user=tenant.user).delete()
    call_command("drf_create_token", tenant.user.username, verbosity=0)
    key = Token.objects.get(user=tenant.user).key
    assert token_client(key).get("/api/v1/ping/").json() == {"pong": True}


def test_a_session_post_needs_the_csrf_token(tenant):
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(tenant.user)
    assert client.get("/api/v1/runs/").status_code == 200  # safe methods need none
    body = assert_error(client.post("/api/v1/runs/", tenant.run_body(), format="json"), 403, "permission_denied")
    assert "CSRF" in body["detail"]
    client.cookies["csrftoken"] = CSRF_SECRET
    wrong = client.post("/api/v1/runs/", tenant.run_body(), format="json", HTTP_X_CSRFTOKEN="B" * 32)
    assert_error(wrong, 403, "permission_denied")
    assert Run.objects.count() == 0
    ok = client.post("/api/v1/runs/", tenant.run_body(), format="json", HTTP_X_CSRFTOKEN=CSRF_SECRET)
    assert ok.status_code == 201
    # token clients are not subject to CSRF
    assert tenant.client.post("/api/v1/runs/", tenant.run_body(), format="json").status_code == 201


def test_unknown_paths_and_methods_answer_in_the_error_shape(tenant):
    assert_error(tenant.client.get("/api/v1/nothing-here/"), 404, "not_found")
    body = assert_error(tenant.client.get("/api/v1/runs"), 404, "not_found")
    assert "/api/v1/runs/" in body["detail"]
    assert_error(tenant.client.get("/api/v1/runs/abc/"), 404, "not_found")
    assert_error(tenant.client.post("/api/v1/escalations/%0A/resolve/", {}, format="json"), 404, "not_found")
    assert_error(tenant.client.get("/api/v1/runs/99999999999999999999999/"), 404, "not_found")
    assert_error(tenant.client.get("/api/v1/organizations/99999999999999999999999/balance/"), 404, "not_found")
    assert_error(tenant.client.put("/api/v1/runs/", {}, format="json"), 405, "method_not_allowed")
    assert_error(tenant.client.post("/api/v1/runs/", "name=x", content_type="application/x-www-form-urlencoded"),
                 415, "unsupported_media_type")
    assert_error(tenant.client.get("/api/v1/runs/", HTTP_ACCEPT="text/csv"), 406, "not_acceptable")


def test_malformed_json_is_400(tenant):
    body = assert_error(tenant.client.post("/api/v1/runs/", "{bad", content_type="application/json"), 400,
                        "validation_error")
    assert "body" in body["errors"]
    assert_error(tenant.client.post("/api/v1/runs/", '{"name": NaN}', content_type="application/json"), 400,
                 "validation_error")


@pytest.mark.parametrize("query", ["project=1e400", "project=-1", "project=99999999999999999999",
                                   "created_after=0001-01-01T00:00:00Z", "created_after=0001-01-01T00:00:00%2B16:00",
                                   "created_before=0139-06-12T23:19:25.854243-16:32",
                                   "created_before=9999-12-31T23:59:59-10:00", "page_size=0", "page=-1",
                                   "status=" + "x" * 5000])
def test_odd_query_values_never_crash(tenant, query):
    response = tenant.client.get(f"/api/v1/runs/?{query}")
    assert response.status_code in (200, 400, 404), (query, response.status_code, response.content)


def test_throttling_is_429_with_retry_after(tenant, settings):
    settings.ORCHESTRATOR_API_RATE = "2/minute"
    assert tenant.client.get("/api/v1/ping/").status_code == 200
    assert tenant.client.get("/api/v1/ping/").status_code == 200
    response = tenant.client.get("/api/v1/ping/")
    body = assert_error(response, 429, "rate_limited")
    assert int(response["Retry-After"]) == body["retry_after"] > 0


def test_a_session_form_post_with_a_key_is_415_not_500(tenant):
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(tenant.user)
    client.cookies["csrftoken"] = CSRF_SECRET
    response = client.post("/api/v1/runs/", {"name": "x", "csrfmiddlewaretoken": CSRF_SECRET},
                           format="multipart", HTTP_IDEMPOTENCY_KEY="k")  # read by the CSRF check
    assert_error(response, 415, "unsupported_media_type")


def test_nul_characters_are_refused_not_stored(tenant):
    """PostgreSQL cannot store U+0000 in text or jsonb: refuse it as bad input everywhere."""
    plan = {"agents": [{"name": "a", "tasks": [{"name": "t", "steps": [
        {"name": "s", "tool": "echo", "args": {"text": "x\u0000y"}}]}]}]}
    body = assert_error(tenant.client.post("/api/v1/runs/", tenant.run_body(plan=plan), format="json"), 400,
                        "validation_error")
    assert "plan" in body["errors"]
    body = assert_error(tenant.client.post("/api/v1/runs/", tenant.run_body(name="a\u0000"), format="json"), 400,
                        "validation_error")
    assert "name" in body["errors"]
    body = assert_error(tenant.client.post("/api/v1/jobs/", {"type": "noop", "project": tenant.project.pk,
                                                             "payload": {"k\u0000": 1}}, format="json"),
                        400, "validation_error")
    assert "payload" in body["errors"]
    assert_error(tenant.client.get("/api/v1/jobs/?type=a%00b"), 400, "validation_error")
