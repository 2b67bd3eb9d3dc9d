"""The OpenAPI schema: served, valid, describing every error code; schemathesis against it."""

from __future__ import annotations

import os

import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, settings
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.test import override_settings
from django.utils import timezone
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from core.api.schema import ERROR_CODES
from jobs.models import WorkerHeartbeat

pytestmark = pytest.mark.django_db

# Per operation; ~30 operations keep the suite to seconds. API_FUZZ_EXAMPLES=200 for a deeper run.
MAX_EXAMPLES = int(os.environ.get("API_FUZZ_EXAMPLES", "8"))


def test_the_schema_is_served_and_describes_every_error_code(client):
    response = client.get("/api/schema/")
    assert response.status_code == 200
    schema = yaml.safe_load(response.content)
    assert schema["openapi"].startswith("3.")
    text = response.content.decode()
    for code in ERROR_CODES:
        assert f"`{code}`" in text, code
    operations = [(path, method) for path, item in schema["paths"].items() for method in item]
    assert len(operations) >= 29
    for path, method in operations:
        operation = schema["paths"][path][method]
        if method == "post":
            assert any(p["name"] == "Idempotency-Key" for p in operation["parameters"]), path
            assert {"400", "409", "422"} <= set(operation["responses"]), path
        if path != "/api/v1/health/":
            assert {"401", "403", "429"} <= set(operation["responses"]), (path, method)
    assert client.get("/api/docs/").status_code == 200


def _load_schema():
    """The schema as served at /api/schema/ (no database needed), called in-process over WSGI."""
    config = SchemathesisConfig.from_dict({
        "phases": {"examples": {"enabled": False}, "coverage": {"enabled": False}, "stateful": {"enabled": False}},
        "generation": {"max-examples": MAX_EXAMPLES, "mode": "all", "deterministic": True, "database": "none"},
    })
    # Rate limits count in the database, which collection may not touch.
    with override_settings(ORCHESTRATOR_API_RATE="", ORCHESTRATOR_API_ANON_RATE=""):
        return schemathesis.openapi.from_wsgi("/api/schema/", get_wsgi_application(), config=config)


schema = _load_schema()


@pytest.fixture
def keep_connection():
    """Like Django's test client: the test's connection (and transaction) survives each request."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def fuzz_tenant(tenant_factory, settings):
    settings.ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS = 20  # POST jobs/ with wait_ms must not stall the run
    now = timezone.now()
    WorkerHeartbeat.objects.create(worker="fuzz:1", started_at=now, last_seen=now)  # health answers 200
    return tenant_factory(credits=10**9)


@schema.parametrize()
# data_too_large: a run's plan nests agents, tasks and steps, and some draws of its body go over
# hypothesis' size limit; those draws are dropped, the operation is still fuzzed.
@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                               HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_the_api_never_answers_500_and_matches_its_schema(case, fuzz_tenant, keep_connection):
    case.call_and_validate(
        headers={"Authorization": f"Token {fuzz_tenant.token}"},
        checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
                response_headers_conformance],
    )


def test_real_answers_match_the_schema(fuzz_tenant, keep_connection):
    """Successful and error answers of a real scenario, each checked against its operation."""
    from werkzeug.test import Client

    from runs.services import escalations
    from runs.models import Run
    from tests.conftest import make_plan

    http = Client(get_wsgi_application())
    auth = {"Authorization": f"Token {fuzz_tenant.token}"}
    checked = []

    def call(method, path, template=None, *, status, headers=None, **kwargs):
        response = http.open(path, method=method, headers={**auth, **(headers or {})}, **kwargs)
        assert response.status_code == status, (method, path, response.get_data(as_text=True))
        operation = schema[template or path.split("?")[0]][method]
        assert str(status) in operation.definition.raw["responses"], (method, path, status)
        operation.validate_response(response)
        checked.append((method, template or path, status))
        return response.get_json()

    project = fuzz_tenant.project.pk
    body = {"project": project, "name": "checked", "plan": make_plan(agents=2)}
    run = call("POST", "/api/v1/runs/", json=body, status=201, headers={"Idempotency-Key": "k"})
    call("POST", "/api/v1/runs/", json=body, status=201, headers={"Idempotency-Key": "k"})
    call("POST", "/api/v1/runs/", json={**body, "name": "other"}, status=422, headers={"Idempotency-Key": "k"})
    call("POST", "/api/v1/runs/", json={"project": project}, status=400)
    detail = "/api/v1/runs/{id}/"
    call("GET", f"/api/v1/runs/{run['id']}/", detail, status=200)
    call("GET", f"/api/v1/runs/?project={project}&status=created", status=200)
    call("POST", f"/api/v1/runs/{run['id']}/start/", "/api/v1/runs/{id}/start/", json={}, status=200)
    call("POST", f"/api/v1/runs/{run['id']}/resume/", "/api/v1/runs/{id}/resume/", json={}, status=409)
    call("GET", f"/api/v1/runs/{run['id']}/events/", "/api/v1/runs/{id}/events/", status=200)
    call("GET", "/api/v1/events/?limit=3", status=200)
    call("GET", "/api/v1/runs/424242/", detail, status=404)
    http_401 = http.open("/api/v1/runs/", method="GET")
    assert http_401.status_code == 401
    schema["/api/v1/runs/"]["GET"].validate_response(http_401)
    job = call("POST", "/api/v1/jobs/", json={"type": "noop", "project": project, "payload": {}}, status=202)
    call("GET", f"/api/v1/jobs/{job['jobId']}/", "/api/v1/jobs/{id}/", status=200)
    call("GET", "/api/v1/jobs/?state=queued", status=200)
    call("POST", f"/api/v1/jobs/{job['jobId']}/cancel/", "/api/v1/jobs/{id}/cancel/", json={}, status=200)
    call("POST", f"/api/v1/jobs/{job['jobId']}/cancel/", "/api/v1/jobs/{id}/cancel/", json={}, status=200)
    ticket, _ = escalations.escalation_open(run=Run.objects.get(pk=run["id"]), trigger="manual", detail="drill")
    call("GET", "/api/v1/escalations/?status=open", status=200)
    call("POST", f"/api/v1/escalations/{ticket.pk}/acknowledge/", "/api/v1/escalations/{id}/acknowledge/",
         json={}, status=200)
    call("GET", "/api/v1/ledger/", status=200)
    call("GET", f"/api/v1/organizations/{fuzz_tenant.organization.pk}/balance/",
         "/api/v1/organizations/{id}/balance/", status=200)
    call("GET", "/api/v1/organizations/", status=200)
    call("GET", "/api/v1/projects/", status=200)
    call("GET", "/api/v1/ping/", status=200)
    call("GET", "/api/v1/health/", status=200)
    assert len(checked) == 24
