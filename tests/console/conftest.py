"""Fixtures for the operations console: operators with exactly the permissions a test names,
and runs, jobs and escalations built through the services."""

from __future__ import annotations

import warnings

import pytest
from django.contrib.auth.models import Group, Permission
from django.db.models import Q
from django.test import Client

from jobs import registry
from jobs.services import job_claim, job_enqueue
from runs import services
from runs.services import escalations
from runs.pipeline import gates
from runs.models import EscalationTicket, Run, Step
from tests.api.conftest import other, tenant, tenant_factory  # noqa: F401  (fixtures, for the retention tests)
from tests.conftest import make_plan, run_ticked

VIEW_APPS = ("core", "billing", "jobs", "runs")
PLAN_STEPS = 3
CREDIT_LIMIT = 3 * PLAN_STEPS  # echo costs 1, three tries per step


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    """No django-q2 message (nothing runs here by itself) and no warning about uncollected static files."""
    monkeypatch.setattr("jobs.wake._send", lambda count: None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="No directory at", category=UserWarning)
        yield


@pytest.fixture
def make_staff(db, django_user_model):
    """``make_staff(name, *perms, group=None)`` → a staff user (no password) with the view permission on
    every model of our apps plus ``perms`` (``"runs.force_fail_run"`` ...)."""

    def make(username: str, *perms: str, group: str | None = None, view: bool = True):
        user = django_user_model.objects.create_user(username=username, is_staff=True)
        wanted = Q(content_type__app_label__in=VIEW_APPS, codename__startswith="view_") if view else Q(pk__in=[])
        for perm in perms:
            app_label, codename = perm.split(".")
            wanted |= Q(content_type__app_label=app_label, codename=codename)
        user.user_permissions.add(*Permission.objects.filter(wanted))
        if group:
            user.groups.add(Group.objects.get(name=group))
        return django_user_model.objects.get(pk=user.pk)  # no cached permissions

    return make


@pytest.fixture
def login():
    """``login(user)`` → a test client logged in as ``user`` (no password check)."""

    def make(user) -> Client:
        client = Client()
        client.force_login(user)
        return client

    return make


@pytest.fixture
def operator_client(make_staff, login):
    """A member of the "Operators" group created by the migration, and nothing else."""
    return login(make_staff("operator-1", group="Operators", view=False))


@pytest.fixture
def viewer_client(make_staff, login):
    """Staff who may look at everything and change nothing."""
    return login(make_staff("viewer-1"))


# --- runs in a given state, through the services --------------------------------------------

def _step(run_id: int, name: str) -> Step:
    run = Run.objects.get(pk=run_id)
    return Step.objects.get(run=run, task__agent__attempt_number=run.attempt_number, name=name)


def build_run(project, state: str, *, name: str | None = None, max_attempts: int = 3) -> Run:
    """A run of 1 agent × 1 task × 3 echo steps in ``state``: from running on, step s0 completed
    (1 credit charged) and s1 is in flight. ``awaiting_approval`` waits at gate ``publish``."""
    plan = make_plan(steps=PLAN_STEPS)
    if state == "awaiting_approval":
        plan["agents"][0]["tasks"][0]["steps"].insert(1, {"name": "gate", "kind": "approval", "gate": "publish"})
    run = services.run_create(project=project, name=name or f"run {state}", plan=plan, max_attempts=max_attempts,
                              credit_limit=CREDIT_LIMIT)
    if state == "created":
        return Run.objects.get(pk=run.pk)
    services.run_start(run_id=run.pk)
    if state == "pending":
        return Run.objects.get(pk=run.pk)
    run_ticked(run.pk)
    attempt = services.step_begin(step_id=_step(run.pk, "s0").pk)
    services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True})
    if state == "awaiting_approval":
        step = _step(run.pk, "gate")
        gates.gate_execute(step=step, attempt=services.step_begin(step_id=step.pk))
        run = Run.objects.get(pk=run.pk)
        assert (run.status, run.status_reason) == ("paused", "awaiting_approval:publish")
        return run
    in_flight = services.step_begin(step_id=_step(run.pk, "s1").pk)
    if state in ("paused", "resuming"):
        services.run_pause(run_id=run.pk)
        if state == "resuming":
            services.run_resume(run_id=run.pk)
    elif state == "completed":
        services.step_attempt_succeed(attempt_id=in_flight.pk, output={"ok": True})
        for name in ("s2",):
            attempt = services.step_begin(step_id=_step(run.pk, name).pk)
            services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True})
    elif state in ("failed", "retrying"):
        services.run_fail(run_id=run.pk, code="worker_lost", message="the worker went away")
        if state == "retrying":
            services.run_retry(run_id=run.pk)
    elif state == "cancelled":
        services.run_cancel(run_id=run.pk)
    run = Run.objects.get(pk=run.pk)
    expected = {"awaiting_approval": "paused"}.get(state, state)
    assert run.status == expected, (run.status, state)
    return run


@pytest.fixture
def run_in(project):
    """``run_in(state)`` → a new run of the default project in ``state`` (see ``build_run``)."""
    return lambda state, **kwargs: build_run(project, state, **kwargs)


@pytest.fixture
def escalation(run_in):
    """``escalation(run=None)`` → an open manual escalation ticket."""

    def make(run=None) -> EscalationTicket:
        run = run or run_in("running")
        ticket, _ = escalations.escalation_open(run=run, trigger=EscalationTicket.Trigger.MANUAL,
                                                detail="needs a look")
        return ticket

    return make


@pytest.fixture
def define_job():
    added: list[str] = []

    def define(**kwargs):
        definition = registry.register(registry.JobDefinition(**kwargs))
        added.append(definition.type)
        return definition

    yield define
    for job_type in added:
        registry._REGISTRY.pop(job_type, None)


@pytest.fixture
def job_in(project, define_job):
    """``job_in(state)`` → a ``console_probe`` job queued, or claimed (``executing``), of the default project."""
    define_job(type="console_probe", run=lambda ctx, payload: {"ok": True}, lane=lambda payload, project_id: "")

    def make(state: str = "executing"):
        # Ahead of any run's tick queued meanwhile (lower runs first), so that it is the one claimed.
        job = job_enqueue(job_type="console_probe", project=project, payload={}, priority=0).job
        if state == "queued":
            return job
        claimed = job_claim(worker="console-test")
        assert claimed is not None and claimed.pk == job.pk
        return claimed

    return make
