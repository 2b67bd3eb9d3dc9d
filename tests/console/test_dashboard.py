"""The operations dashboard: who may see it, what its snapshot says about data made through the
services, that every figure leads to the rows behind it, and that its cost does not grow with rows."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import DatabaseError, connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from billing.models import CreditAccount
from console.dashboard import dashboard_snapshot
from jobs.models import WorkerHeartbeat
from jobs.services import job_claim, job_complete, job_enqueue, job_fail
from runs import services
from runs.services import escalations
from runs.models import EscalationTicket, Run
from tests.conftest import make_plan
from tests.console.conftest import build_run

pytestmark = pytest.mark.django_db

DASHBOARD = "/admin/dashboard/"
DATA = "/admin/dashboard/data/"


@pytest.fixture
def lane_jobs(define_job):
    """Two job types whose lane comes from the payload."""
    for job_type in ("dash_alpha", "dash_beta"):
        define_job(type=job_type, run=lambda ctx, payload: {"ok": True},
                   lane=lambda payload, project_id: payload.get("lane", ""),
                   validate=lambda payload: payload)


def by_key(rows: list[dict], key: str = "key") -> dict:
    return {row[key]: row for row in rows}


# --- access -----------------------------------------------------------------------------------

def test_dashboard_is_linked_from_the_index_and_the_header_and_renders_for_staff(make_staff, login):
    client = login(make_staff("watcher"))
    index = client.get(reverse("admin:index"))
    assert index.status_code == 200
    assert b'data-link="dashboard"' in index.content and b'id="nav-dashboard"' in index.content
    assert reverse("dashboard:index") == DASHBOARD
    page = client.get(DASHBOARD)
    assert page.status_code == 200
    html = page.content.decode()
    for hook in ('id="dashboard-chart"', 'data-metric="runs-running"', 'data-metric="runs-stuck"',
                 'data-metric="jobs-waiting"', 'data-metric="credits-reserved"', 'data-metric="workers-alive"',
                 'data-table="lanes"', 'data-table="executing"', 'orchestrator/dashboard.js',
                 'id="dashboard-snapshot"', f'data-url="{DATA}"'):
        assert hook in html, hook
    # Another admin page carries the link in its header too.
    assert b'id="nav-dashboard"' in client.get(reverse("admin:runs_run_changelist")).content


def test_dashboard_refuses_anonymous_and_non_staff_users(client, django_user_model, login):
    page = client.get(DASHBOARD)
    assert page.status_code == 302 and page["Location"].startswith(reverse("admin:login"))
    data = client.get(DATA)
    assert data.status_code == 401 and data.json()["code"] == "not_authenticated"

    member = login(django_user_model.objects.create_user(username="member"))
    page = member.get(DASHBOARD)
    assert page.status_code == 302 and page["Location"].startswith(reverse("admin:login"))
    data = member.get(DATA)
    assert data.status_code == 403 and data.json() == {"code": "permission_denied",
                                                        "detail": "the dashboard is for staff users"}


def test_data_answers_json_errors_never_500(make_staff, login, monkeypatch):
    client = login(make_staff("watcher"))
    refused = client.post(DATA)
    assert refused.status_code == 405 and refused.json()["code"] == "method_not_allowed"

    def broken(**kwargs):
        raise DatabaseError("connection lost")

    monkeypatch.setattr("console.admin_dashboard.dashboard_snapshot", broken)
    failed = client.get(DATA)
    assert failed.status_code == 503 and failed.json()["code"] == "dashboard_unavailable"


# --- figures ----------------------------------------------------------------------------------

@pytest.fixture
def scene(org_factory, lane_jobs, settings):
    """Jobs, runs, failures, escalations and workers, all made through the services."""
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 3
    organization, project, owner = org_factory(credits=10_000)
    first = job_enqueue(job_type="dash_alpha", project=project, payload={"lane": "L1"}).job
    job_enqueue(job_type="dash_alpha", project=project, payload={"lane": "L1"})
    job_enqueue(job_type="dash_beta", project=project, payload={"lane": "L2"})
    job_enqueue(job_type="dash_beta", project=project, payload={"lane": "L3"},
                not_before=timezone.now() + timedelta(minutes=5))
    claimed = job_claim(worker="dash-worker")
    assert claimed.pk == first.pk
    quick = job_enqueue(job_type="dash_beta", project=project, payload={"lane": "L4"}, priority=1).job
    done = job_claim(worker="dash-worker")
    assert done.pk == quick.pk
    assert job_complete(job_id=done.pk, attempt=done.attempts, result={"ok": True})
    for reason, lane in (("fatal_error", "F1"), ("fatal_error", "F2"), ("invalid_payload", "F3")):
        doomed = job_enqueue(job_type="dash_beta", project=project, payload={"lane": lane}).job
        job_fail(job_id=doomed.pk, reason=reason, error="boom")

    runs = {state: build_run(project, state, name=f"dash {state}")
            for state in ("created", "pending", "running", "paused", "failed", "completed")}
    second_running = build_run(project, "running", name="dash running 2")
    open_ticket, _ = escalations.escalation_open(run=runs["running"], trigger=EscalationTicket.Trigger.MANUAL,
                                                 detail="look")
    acked, _ = escalations.escalation_open(run=second_running, trigger=EscalationTicket.Trigger.MANUAL,
                                           detail="look too")
    escalations.escalation_acknowledge(ticket_id=acked.pk, actor=owner, reason="on it")
    now = timezone.now()
    WorkerHeartbeat.objects.create(worker="live-host:1", started_at=now - timedelta(minutes=5), last_seen=now)
    long_ago = now - timedelta(hours=2)
    WorkerHeartbeat.objects.create(worker="gone-host:1", started_at=long_ago, last_seen=long_ago)
    return {"organization": organization, "project": project, "runs": runs, "second_running": second_running,
            "executing": claimed, "open_ticket": open_ticket}


def test_snapshot_figures_match_the_data(scene, settings):
    settings.ORCHESTRATOR_RUN_PENDING_TIMEOUT_S = 0  # every pending run is stuck now
    snapshot = dashboard_snapshot()
    metrics = snapshot["metrics"]

    lanes = by_key(snapshot["queue"]["by_lane"])
    prefix = f"project:{scene['project'].pk}:user:"  # a lane a payload names lives in its project
    # The pending run's job (a run_step job, in no lane), queued with its start, waits for a worker.
    assert {key: (row["waiting"], row["delayed"], row["executing"]) for key, row in lanes.items()} == {
        f"{prefix}L1": (1, 0, 1), f"{prefix}L2": (1, 0, 0), f"{prefix}L3": (1, 1, 0), "": (1, 0, 0)}
    types = by_key(snapshot["queue"]["by_type"])
    assert {key: (row["waiting"], row["delayed"], row["executing"]) for key, row in types.items()} == {
        "dash_alpha": (1, 0, 1), "dash_beta": (2, 1, 0), "run_step": (1, 0, 0)}
    assert (metrics["jobs-waiting"], metrics["jobs-delayed"], metrics["jobs-executing"]) == (4, 1, 1)
    assert metrics["jobs-concurrency"] == 3
    executing = snapshot["queue"]["executing_jobs"]
    assert [row["id"] for row in executing] == [scene["executing"].pk]
    assert executing[0]["worker"] == "dash-worker" and executing[0]["age_s"] >= 0

    runs = scene["runs"]
    assert metrics["runs-running"] == 2 and metrics["runs-pending"] == 1 and metrics["runs-paused"] == 1
    assert metrics["runs-created"] == 1 and metrics["runs-live"] == 5
    assert metrics["runs-stuck"] == 1
    assert [row["id"] for row in snapshot["runs"]["stuck"]] == [runs["pending"].pk]

    failures = snapshot["failures"]
    assert [(row["reason"], row["count"]) for row in failures["jobs_by_reason"]] == [
        ("fatal_error", 2), ("invalid_payload", 1)]
    assert [(row["code"], row["count"]) for row in failures["runs_by_code"]] == [("worker_lost", 1)]
    assert (metrics["failures-jobs-1h"], metrics["failures-runs-1h"]) == (3, 1)

    held = sum(run.credits_reserved - run.credits_charged - run.credits_refunded
               for run in Run.objects.filter(status__in=["pending", "running", "paused"]))
    assert held > 0
    assert metrics["credits-reserved"] == held == CreditAccount.objects.get(organization=scene["organization"]).reserved
    assert metrics["credits-organizations"] == 1
    assert [row["organization"] for row in snapshot["credits"]["top"]] == [scene["organization"].name]

    assert (metrics["escalations-open"], metrics["escalations-acknowledged"]) == (1, 1)
    assert {row["id"] for row in snapshot["escalations"]["latest"]} == set(
        EscalationTicket.objects.values_list("pk", flat=True))

    assert (metrics["workers-alive"], metrics["workers-stale"]) == (1, 1)
    workers = by_key(snapshot["queue"]["workers"], "worker")
    assert workers["gone-host:1"]["alive"] is False and workers["gone-host:1"]["last_seen_s"] >= 7200
    assert workers["live-host:1"]["alive"] is True

    chart = snapshot["chart"]
    assert chart["buckets"] == 60 and all(len(values) == 60 for values in chart["series"].values())
    assert chart["totals"]["jobs_completed"] == 1 == metrics["throughput-jobs-1h"]
    assert chart["totals"]["runs_completed"] == 1 == metrics["throughput-runs-1h"]
    assert chart["totals"]["failures"] == 4 == metrics["failures-1h"]  # 3 jobs and 1 run
    assert sum(chart["series"]["failures"][-2:]) == 4  # all in the last minute or two


def test_json_endpoint_serves_the_same_snapshot(scene, make_staff, login):
    response = login(make_staff("watcher")).get(DATA)
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    data = response.json()
    expected = dashboard_snapshot()
    assert data["metrics"] == expected["metrics"]
    def without_ages(rows):
        return [{key: value for key, value in row.items() if not key.endswith("_s")} for row in rows]

    assert without_ages(data["queue"]["by_lane"]) == without_ages(expected["queue"]["by_lane"])
    assert data["chart"]["totals"] == expected["chart"]["totals"]
    assert data["failures"] == expected["failures"]


def test_page_shows_the_figures(scene, make_staff, login):
    html = login(make_staff("watcher")).get(DASHBOARD).content.decode()
    assert 'data-metric="runs-running" data-value="2"' in html
    assert 'data-metric="escalations-open" data-value="1"' in html
    assert 'data-tile="escalations-open" data-alert="nonzero"' in html
    assert f'data-job="{scene["executing"].pk}"' in html
    assert f'data-lane="project:{scene["project"].pk}:user:L3"' in html and 'data-reason="fatal_error"' in html


def listed_ids(client, url: str) -> set[int]:
    response = client.get(url)
    assert response.status_code == 200, url
    return {obj.pk for obj in response.context["cl"].result_list}


def test_every_figure_links_to_the_rows_behind_it(scene, make_staff, login, settings):
    settings.ORCHESTRATOR_RUN_PENDING_TIMEOUT_S = 0
    client = login(make_staff("watcher"))
    snapshot = dashboard_snapshot()
    for metric, url in snapshot["links"].items():
        assert client.get(url).status_code == 200, (metric, url)
    links, runs = snapshot["links"], scene["runs"]
    assert listed_ids(client, links["runs-stuck"]) == {runs["pending"].pk}
    assert listed_ids(client, links["runs-running"]) == {runs["running"].pk, scene["second_running"].pk}
    assert len(listed_ids(client, links["jobs-waiting"])) == snapshot["metrics"]["jobs-waiting"]
    assert listed_ids(client, links["jobs-executing"]) == {scene["executing"].pk}
    assert len(listed_ids(client, links["failures-jobs-1h"])) == 3
    assert listed_ids(client, links["escalations-open"]) == {scene["open_ticket"].pk}
    assert len(listed_ids(client, links["credits-reserved"])) == 1
    lanes = by_key(snapshot["queue"]["by_lane"])
    assert len(listed_ids(client, lanes[f"project:{scene['project'].pk}:user:L1"]["url"])) == 1
    fatal = by_key(snapshot["failures"]["jobs_by_reason"], "reason")["fatal_error"]
    assert len(listed_ids(client, fatal["url"])) == 2
    lost = by_key(snapshot["failures"]["runs_by_code"], "code")["worker_lost"]
    assert listed_ids(client, lost["url"]) == {runs["failed"].pk}
    for row in snapshot["queue"]["executing_jobs"] + snapshot["runs"]["stuck"] + snapshot["escalations"]["latest"]:
        assert client.get(row["url"]).status_code == 200


# --- cost -------------------------------------------------------------------------------------

def _populate(project, start: int, count: int) -> None:
    """``count`` more of everything: jobs in their own lanes and types, failed jobs, runs in
    several states, escalations and workers."""
    now = timezone.now()
    for n in range(start, start + count):
        job_enqueue(job_type="dash_alpha" if n % 2 else "dash_beta", project=project, payload={"lane": f"lane-{n}"})
        doomed = job_enqueue(job_type="dash_beta", project=project, payload={"lane": f"doomed-{n}"}).job
        job_fail(job_id=doomed.pk, reason=["fatal_error", "timeout", "invalid_payload"][n % 3], error="boom")
        run = services.run_create(project=project, name=f"bulk {n}", plan=make_plan(), credit_limit=2)
        if n % 2:
            services.run_start(run_id=run.pk)
        if n % 5 == 0:
            escalations.escalation_open(run=run, trigger=EscalationTicket.Trigger.MANUAL, detail="bulk")
        WorkerHeartbeat.objects.create(worker=f"host:{n}", started_at=now, last_seen=now - timedelta(seconds=n))


def _snapshot_queries() -> int:
    with CaptureQueriesContext(connection) as queries:
        dashboard_snapshot()
    return len(queries.captured_queries)


def test_snapshot_query_count_does_not_grow_with_rows(org_factory, lane_jobs, settings):
    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = 1_000
    settings.ORCHESTRATOR_RUN_PENDING_TIMEOUT_S = 0  # pending runs count as stuck: that list fills up too
    _, project, _ = org_factory(credits=100_000)
    _populate(project, 0, 10)
    small = _snapshot_queries()
    _populate(project, 10, 190)
    large = _snapshot_queries()
    snapshot = dashboard_snapshot()
    assert snapshot["queue"]["lanes_total"] >= 200 and len(snapshot["queue"]["by_lane"]) == 20
    assert snapshot["metrics"]["runs-stuck"] == 100 and len(snapshot["runs"]["stuck"]) == 20
    assert large == small
    assert small <= 20
