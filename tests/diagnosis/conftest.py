"""Diagnosis fixtures: runs that fail through the services, and API and admin clients."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission
from django.core.cache import cache
from django.db.models import Q
from django.test import Client
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from billing.services import organization_create
from runs import services
from runs.models import Run, Step, StepAttempt
from tests.conftest import run_ticked


@pytest.fixture(autouse=True)
def no_wake_messages(monkeypatch):
    """Jobs are claimed in-process by the tests; no django-q2 message is sent."""
    monkeypatch.setattr("jobs.wake._send", lambda count: None)


@pytest.fixture(autouse=True)
def clear_throttle_cache():
    cache.clear()
    yield
    cache.clear()


def drill(name: str, mode: str = "retryable", times: int = 9) -> dict:
    return {"name": name, "tool": "fail", "args": {"mode": mode, "times": times}}


def echo(name: str) -> dict:
    return {"name": name, "tool": "echo", "args": {"text": name}}


def one_task_plan(*steps: dict, task_mode: str = "fail-fast", agent_mode: str = "fail-fast",
                  bystander: bool = False) -> dict:
    """Agent a0 with task t0 of ``steps``; with ``bystander``, a second agent a1 (one echo step), so
    that a0 failing is not "more than half the agents" (no re-plan)."""
    agents = [{"name": "a0", "failure_mode": agent_mode,
               "tasks": [{"name": "t0", "failure_mode": task_mode, "steps": list(steps)}]}]
    if bystander:
        agents.append({"name": "a1", "tasks": [{"name": "tb", "steps": [echo("b0")]}]})
    return {"agents": agents}


def running_run(project, plan: dict, **options) -> Run:
    run = services.run_create(project=project, name="diagnosed", plan=plan, **options)
    services.run_start(run_id=run.pk)
    return run_ticked(run.pk)


def current_step(run_id: int, name: str) -> Step:
    run = Run.objects.get(pk=run_id)
    return Step.objects.get(run=run, task__agent__attempt_number=run.attempt_number, name=name)


@pytest.fixture
def clock(monkeypatch):
    """A frozen ``timezone.now`` that a test moves forward by hand (no sleeping)."""

    class Clock:
        def __init__(self) -> None:
            self.now = timezone.now()

        def __call__(self):
            return self.now

        def advance(self, **delta) -> None:
            self.now += timedelta(**delta)

    frozen = Clock()
    monkeypatch.setattr(timezone, "now", frozen)
    return frozen


@pytest.fixture
def fail_step(django_capture_on_commit_callbacks, clock):
    """``fail_step(run, name, code=..., retryable=...)`` begins the step and fails that attempt, running
    the after-commit hooks (the explanation request) as a real commit would; when the engine schedules
    a retry, the clock moves past its backoff. Returns the attempt."""

    def fail(run: Run, name: str, *, code: str = "drill_retryable", message: str = "drill: it broke",
             retryable: bool = True, took_ms: int = 20) -> StepAttempt:
        attempt = services.step_begin(step_id=current_step(run.pk, name).pk)
        clock.advance(milliseconds=took_ms)
        with django_capture_on_commit_callbacks(execute=True):
            outcome = services.step_attempt_fail(attempt_id=attempt.pk, code=code, message=message,
                                                 retryable=retryable)
        if outcome.decision == "retry":
            clock.advance(milliseconds=outcome.delay_ms)
        return StepAttempt.objects.get(pk=attempt.pk)

    return fail


@pytest.fixture
def tenant_factory(db):
    """``tenant_factory()`` → (organization, project, owner, token API client)."""
    counter = {"n": 0}

    def make(*, credits: int = 1_000):
        counter["n"] += 1
        label = f"diag-org-{counter['n']}"
        organization, project, owner, _ = organization_create(name=label, owner_username=f"{label}-owner",
                                                              credits=credits)
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=owner).key}")
        return organization, project, owner, client

    return make


@pytest.fixture
def make_staff(db, django_user_model):
    """``make_staff(name, *perms)`` → a staff user with the view permission on runs plus ``perms``."""

    def make(username: str, *perms: str):
        user = django_user_model.objects.create_user(username=username, is_staff=True)
        wanted = Q(content_type__app_label__in=("core", "billing", "jobs", "runs", "diagnosis"),
                   codename__startswith="view_")
        for perm in perms:
            app_label, codename = perm.split(".")
            wanted |= Q(content_type__app_label=app_label, codename=codename)
        user.user_permissions.add(*Permission.objects.filter(wanted))
        return django_user_model.objects.get(pk=user.pk)

    return make


@pytest.fixture
def login():
    def make(user, **options) -> Client:
        client = Client(**options)
        client.force_login(user)
        return client

    return make
