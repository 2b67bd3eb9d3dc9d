"""End to end with real processes: daphne + qcluster + a WebSocket client following a run."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from django.conf import settings
from django.db import connection

from core.models import Event
from runs import services
from runs.models import Run
from tests.conftest import make_plan
from tests.processes import Cluster, Daphne, restart_postgres, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.postgres]


def cookie_for(client, user) -> str:
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"


class Follower:
    """A websockets client subscribed to one run; remembers every event it got."""

    def __init__(self, port: int, cookie: str):
        self.port, self.cookie = port, cookie
        self.events: list[dict] = []
        self.socket = None

    def open(self, run_id: int, after: int = 0) -> None:
        from websockets.sync.client import connect

        self.socket = connect(f"ws://127.0.0.1:{self.port}/ws/events/", origin="http://localhost",
                              additional_headers={"Cookie": self.cookie}, open_timeout=10).__enter__()
        assert json.loads(self.socket.recv(timeout=10))["type"] == "hello"
        self.socket.send(json.dumps({"action": "subscribe", "run": run_id, "after": after}))
        assert json.loads(self.socket.recv(timeout=10))["type"] == "subscribed"

    def read(self, *, until_type: str | None = None, count: int | None = None, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        got = 0
        while time.monotonic() < deadline:
            try:
                message = json.loads(self.socket.recv(timeout=max(0.1, deadline - time.monotonic())))
            except TimeoutError:
                break
            if "id" not in message:
                continue
            self.events.append(message)
            got += 1
            if (until_type and message["type"] == until_type) or (count and got >= count):
                return
        raise AssertionError(f"stream ended early: {[e['type'] for e in self.events][-5:]}")

    def close(self) -> None:
        self.socket.close()


def assert_complete_stream(follower: Follower, run: Run) -> None:
    """Every event of the run up to its completion arrived once, in id order."""
    last = Event.objects.get(run_id=run.pk, type="run_completed").pk
    expected = list(Event.objects.filter(run_id=run.pk, id__lte=last).order_by("id").values_list("id", flat=True))
    got = [event["id"] for event in follower.events]
    assert got == expected, (len(got), len(expected))


def test_a_client_follows_a_run_across_a_reconnect_and_a_database_restart(org_factory, client, tmp_path):
    if shutil.which("pg_ctlcluster") is None:
        pytest.skip("needs pg_ctlcluster to restart the local PostgreSQL server")
    _, project, owner = org_factory()
    cookie = cookie_for(client, owner)
    plan = make_plan(agents=2, tasks=2, steps=2, tool="sleep", args={"seconds": 0.4})
    with Daphne(tmp_path / "daphne.log") as daphne, Cluster(tmp_path / "qcluster.log", ORCHESTRATOR_Q_NAME="live"):
        run = services.run_create(project=project, name="followed", plan=plan)
        follower = Follower(daphne.port, cookie)
        follower.open(run.pk)
        services.run_start(run_id=run.pk)
        follower.read(count=12)
        follower.close()  # the client drops mid-run ...
        time.sleep(1.0)
        follower.open(run.pk, after=follower.events[-1]["id"])  # ... and comes back with `after`
        follower.read(count=5)
        restart_postgres()  # the relay's LISTEN connection and every worker connection break
        connection.close()
        follower.read(until_type="run_completed", timeout=120)
        follower.close()
    run.refresh_from_db()
    assert run.status == Run.Status.COMPLETED
    assert_complete_stream(follower, run)
