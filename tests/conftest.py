"""Shared fixtures. State is always built through the services, never by writing rows."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.db import connection

from billing.services import organization_create
from tests.ledger_guard import flush_lifting_ledger_triggers

ON_POSTGRES = settings.DATABASE_IS_POSTGRES

# The ledger's triggers refuse TRUNCATE (PostgreSQL) and DELETE (SQLite); the flush between
# transactional tests lifts them in its own transaction (tests/ledger_guard.py).
flush_lifting_ledger_triggers()


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def pytest_collection_modifyitems(config, items):
    if ON_POSTGRES:
        return
    skip = pytest.mark.skip(reason="needs PostgreSQL (row locks, SKIP LOCKED, triggers): "
                                   "set DATABASE_URL=postgres://... to run it")
    for item in items:
        if "postgres" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def stray_sessions_closed(request):
    """On PostgreSQL, end the sessions a test's processes or threads left on the test database
    (a relay thread, a killed worker's backend) before it is dropped, so the drop never fails."""
    if not ON_POSTGRES:
        yield
        return
    request.getfixturevalue("django_db_setup")  # set up before, torn down after this fixture
    yield
    blocker = request.getfixturevalue("django_db_blocker")
    with blocker.unblock(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")


def pytest_sessionfinish(session, exitstatus):
    """Django drops the SQLite test database file but leaves its WAL sidecars (``-wal``, ``-shm``)."""
    from pathlib import Path

    database = settings.DATABASES["default"]
    name = (database.get("TEST") or {}).get("NAME")
    if ON_POSTGRES or not name or Path(name).exists():
        return
    for suffix in ("-wal", "-shm"):
        Path(f"{name}{suffix}").unlink(missing_ok=True)


@pytest.fixture
def org_factory(db):
    counter = {"n": 0}

    def make(*, credits: int = 1_000, name: str | None = None, owner: str | None = None):
        counter["n"] += 1
        organization, project, owner_user, _ = organization_create(
            name=name or f"org-{counter['n']}", owner_username=owner or f"owner-{counter['n']}", credits=credits)
        return organization, project, owner_user

    return make


@pytest.fixture
def org(org_factory):
    return org_factory()[0]


@pytest.fixture
def project(org):
    return org.projects.get(name="default")


@pytest.fixture
def operator(django_user_model):
    return django_user_model.objects.create_user(username="op", password="pw", is_staff=True)


def make_plan(agents: int = 1, tasks: int = 1, steps: int = 1, *, tool: str = "echo", args: dict | None = None,
              **agent_options) -> dict:
    """A plan of ``agents × tasks × steps`` steps of one tool."""
    args = args if args is not None else ({"text": "hi"} if tool == "echo" else {})
    return {
        "agents": [
            {"name": f"a{a}", **agent_options, "tasks": [
                {"name": f"t{t}", "steps": [{"name": f"s{s}", "tool": tool, "args": dict(args)} for s in range(steps)]}
                for t in range(tasks)
            ]}
            for a in range(agents)
        ]
    }


@pytest.fixture
def plan():
    return make_plan()


@pytest.fixture
def db_vendor():
    return connection.vendor


def run_ticked(run_id: int):
    """What a started run's worker job does first, done by hand: pending → running, and the job
    queued with the start (or the retry) gone (finished, its row retired), so that no job of the run
    waits in the queue but those the test queues."""
    from jobs.models import Job
    from runs import services

    run = services.run_mark_running(run_id=run_id)
    Job.objects.filter(run_id=run_id, type__in=["run_tick", "run_step"], state="queued").delete()
    return run
