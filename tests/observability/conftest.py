"""Fixtures of the observability tests: API tenants (as in tests/api), job definitions, a staff user."""

from __future__ import annotations

import pytest

from jobs import registry
from tests.api.conftest import other, tenant, tenant_factory  # noqa: F401  (fixtures)


@pytest.fixture(autouse=True)
def no_wake_messages(monkeypatch):
    """Jobs are claimed in-process by the tests that need them; no django-q2 message is sent."""
    monkeypatch.setattr("jobs.wake._send", lambda count: None)


@pytest.fixture
def define_job():
    """Register job definitions for one test and remove them afterwards."""
    added: list[str] = []

    def define(**kwargs):
        definition = registry.register(registry.JobDefinition(**kwargs))
        added.append(definition.type)
        return definition

    yield define
    for job_type in added:
        registry._REGISTRY.pop(job_type, None)


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user(username="metrics-staff", password="pw", is_staff=True)
