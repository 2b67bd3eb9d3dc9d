"""API fixtures: tenants (organization, project, owner, token client) built through services."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from django.core.cache import cache
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from billing.services import organization_create
from core.models import Organization, Project
from tests.conftest import make_plan


@dataclass
class Tenant:
    organization: Organization
    project: Project
    user: object
    token: str
    client: APIClient

    def run_body(self, **overrides) -> dict:
        body = {"project": self.project.pk, "name": "api run", "plan": make_plan()}
        body.update(overrides)
        return body


def token_client(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


@pytest.fixture(autouse=True)
def no_wake_messages(monkeypatch):
    """Jobs are claimed in-process by the tests that need them; no django-q2 message is sent."""
    monkeypatch.setattr("jobs.wake._send", lambda count: None)


@pytest.fixture(autouse=True)
def clear_throttle_cache():
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def tenant_factory(db):
    counter = {"n": 0}

    def make(*, credits: int = 1_000, name: str | None = None) -> Tenant:
        counter["n"] += 1
        label = name or f"api-org-{counter['n']}"
        organization, project, owner, _ = organization_create(name=label, owner_username=f"{label}-owner",
                                                              credits=credits)
        token = Token.objects.create(user=owner).key
        return Tenant(organization, project, owner, token, token_client(token))

    return make


@pytest.fixture
def tenant(tenant_factory) -> Tenant:
    return tenant_factory()


@pytest.fixture
def other(tenant_factory) -> Tenant:
    """Another organization: none of its ids may answer anything but 404 to ``tenant``."""
    return tenant_factory()


def create_run(tenant: Tenant, **overrides) -> dict:
    response = tenant.client.post("/api/v1/runs/", tenant.run_body(**overrides), format="json")
    assert response.status_code == 201, response.content
    return response.json()


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, (response.status_code, response.content)
    body = response.json()
    assert body["code"] == code, body
    assert isinstance(body["detail"], str) and body["detail"]
    return body
