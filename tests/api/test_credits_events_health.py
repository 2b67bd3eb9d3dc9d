"""Balances, the ledger, escalations, the event feed, organizations, projects and health."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission
from django.utils import timezone

from core.services import event_record
from jobs.models import WorkerHeartbeat
from runs.services import escalations
from runs.models import Run
from tests.api.conftest import assert_error, create_run

pytestmark = pytest.mark.django_db


def test_balance_shows_balance_reserved_and_available(tenant):
    run = create_run(tenant, credit_limit=40)
    tenant.client.post(f"/api/v1/runs/{run['id']}/start/", format="json")
    body = tenant.client.get(f"/api/v1/organizations/{tenant.organization.pk}/balance/").json()
    assert body == {"organization": tenant.organization.pk, "balance": 1000, "reserved": 40, "available": 960}


def test_ledger_lists_and_filters_entries(tenant):
    run = create_run(tenant, credit_limit=40)
    tenant.client.post(f"/api/v1/runs/{run['id']}/start/", format="json")
    tenant.client.post(f"/api/v1/runs/{run['id']}/cancel/", format="json")
    rows = tenant.client.get("/api/v1/ledger/").json()["results"]
    assert [(row["kind"], row["amount"]) for row in rows] == [("refund", 40), ("reserve", 40), ("topup", 1000)]
    assert rows[0]["actor"] == tenant.user.username and rows[0]["run"] == run["id"]
    assert [row["kind"] for row in tenant.client.get(f"/api/v1/ledger/?run={run['id']}").json()["results"]] == [
        "refund", "reserve"]
    assert [row["amount"] for row in tenant.client.get("/api/v1/ledger/?kind=topup").json()["results"]] == [1000]
    assert tenant.client.get(f"/api/v1/ledger/{rows[-1]['id']}/").json()["kind"] == "topup"
    assert_error(tenant.client.get("/api/v1/ledger/?kind=gift"), 400, "validation_error")
    assert_error(tenant.client.get("/api/v1/ledger/?run=999999"), 404, "not_found")


def test_escalations_list_filter_acknowledge_and_resolve(tenant):
    run = create_run(tenant)
    ticket, _ = escalations.escalation_open(run=Run.objects.get(pk=run["id"]), trigger="manual", detail="look")
    rows = tenant.client.get("/api/v1/escalations/?status=open").json()["results"]
    assert [row["id"] for row in rows] == [ticket.pk] and rows[0]["run"] == run["id"]
    assert tenant.client.get("/api/v1/escalations/?status=resolved").json()["results"] == []
    assert [row["id"] for row in tenant.client.get(f"/api/v1/escalations/?run={run['id']}").json()["results"]] == [
        ticket.pk]
    acked = tenant.client.post(f"/api/v1/escalations/{ticket.pk}/acknowledge/", format="json").json()
    assert (acked["status"], acked["acknowledged_by"]) == ("acknowledged", tenant.user.username)
    assert_error(tenant.client.post(f"/api/v1/escalations/{ticket.pk}/resolve/", {}, format="json"), 400,
                 "validation_error")
    resolved = tenant.client.post(f"/api/v1/escalations/{ticket.pk}/resolve/", {"reason": "fixed"},
                                  format="json").json()
    assert (resolved["status"], resolved["resolution"]) == ("resolved", "fixed")
    body = assert_error(tenant.client.post(f"/api/v1/escalations/{ticket.pk}/acknowledge/", format="json"), 409,
                        "invalid_transition")
    assert (body["from"], body["to"]) == ("resolved", "acknowledge")
    assert_error(tenant.client.get("/api/v1/escalations/?status=nope"), 400, "validation_error")


def test_organizations_and_projects_of_the_caller(tenant):
    orgs = tenant.client.get("/api/v1/organizations/").json()["results"]
    assert [org["id"] for org in orgs] == [tenant.organization.pk]
    assert tenant.client.get(f"/api/v1/organizations/{tenant.organization.pk}/").json()["name"] == \
        tenant.organization.name
    projects = tenant.client.get(f"/api/v1/projects/?organization={tenant.organization.pk}").json()["results"]
    assert [(p["id"], p["name"]) for p in projects] == [(tenant.project.pk, "default")]
    assert tenant.client.get(f"/api/v1/projects/{tenant.project.pk}/").json()["organization"] == \
        tenant.organization.pk


def test_events_are_envelopes_in_id_order_with_a_cursor(tenant):
    run = create_run(tenant)
    tenant.client.post(f"/api/v1/runs/{run['id']}/start/", format="json")
    page = tenant.client.get("/api/v1/events/?limit=2").json()
    first = page["results"]
    assert len(first) == 2 and first[0]["id"] < first[1]["id"] and page["next"]
    event = first[0]
    assert {"id", "type", "ts", "organization", "project", "run"} <= set(event)
    assert event["type"] == "organization_created" and event["name"] == tenant.organization.name
    seen = [e["id"] for e in first]
    url = page["next"]
    while url:
        page = tenant.client.get(url).json()
        seen += [e["id"] for e in page["results"]]
        url = page["next"]
    everything = tenant.client.get("/api/v1/events/?limit=500").json()["results"]
    assert seen == [e["id"] for e in everything] == sorted(seen)
    run_events = tenant.client.get(f"/api/v1/events/?run={run['id']}").json()["results"]
    assert [e["type"] for e in run_events] == ["run_created", "ledger_reserve", "run_pending",
                                               "orchestrator_job_queued"]
    project_events = tenant.client.get(f"/api/v1/events/?project={tenant.project.pk}").json()["results"]
    assert {e["project"] for e in project_events} == {tenant.project.pk}
    after = tenant.client.get(f"/api/v1/events/?after={everything[-2]['id']}").json()
    assert [e["id"] for e in after["results"]] == [everything[-1]["id"]] and after["next"] is None
    assert_error(tenant.client.get("/api/v1/events/?after=-1"), 400, "validation_error")
    assert_error(tenant.client.get("/api/v1/events/?limit=501"), 400, "validation_error")


def test_staff_with_view_event_see_every_organizations_events(tenant, other, django_user_model):
    event_record(type="system_note", organization_id=None, payload={"note": "engine"})
    mine = {e["organization"] for e in tenant.client.get("/api/v1/events/?limit=500").json()["results"]}
    assert mine == {tenant.organization.pk}
    tenant.user.user_permissions.add(Permission.objects.get(codename="view_event", content_type__app_label="core"))
    mine = {e["organization"] for e in tenant.client.get("/api/v1/events/?limit=500").json()["results"]}
    assert mine == {tenant.organization.pk}  # the permission without staff status: still its own only
    tenant.user.is_staff = True
    tenant.user.save(update_fields=["is_staff"])
    everything = tenant.client.get("/api/v1/events/?limit=500").json()["results"]
    assert {e["organization"] for e in everything} == {tenant.organization.pk, other.organization.pk, None}
    theirs = tenant.client.get(f"/api/v1/events/?organization={other.organization.pk}").json()["results"]
    assert theirs and {e["organization"] for e in theirs} == {other.organization.pk}


@pytest.fixture
def client(client, settings):
    """A client holding the metrics token: health answers it with every part."""
    settings.ORCHESTRATOR_METRICS_TOKEN = "health-details"
    client.defaults["HTTP_AUTHORIZATION"] = "Bearer health-details"
    return client


def test_health_is_503_naming_the_failing_parts_then_200(client, settings):
    response = client.get("/api/v1/health/")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "failing" and body["failing"] == ["workers"]
    assert body["database"]["ok"] and body["broker"]["ok"] and body["queue"] == {"ok": True, "enabled": True}
    assert body["relay"] == "not running"
    now = timezone.now()
    WorkerHeartbeat.objects.create(worker="host:1", started_at=now, last_seen=now)
    WorkerHeartbeat.objects.create(worker="host:2", started_at=now, last_seen=now - timedelta(minutes=5))
    response = client.get("/api/v1/health/")
    assert response.status_code == 200, response.content
    assert response.json()["workers"] == {"ok": True, "seen_last_minute": 1}
    settings.ORCHESTRATOR_QUEUE_ENABLED = False
    assert client.get("/api/v1/health/").json()["failing"] == ["queue"]


def test_health_reports_a_broken_part_and_relay_lag(client, monkeypatch):
    from jobs.api import views

    now = timezone.now()
    WorkerHeartbeat.objects.create(worker="host:1", started_at=now, last_seen=now)

    def broken():
        raise ConnectionError("broker down")

    monkeypatch.setitem(views.HEALTH_CHECKS, "broker", broken)
    monkeypatch.setattr("core.relay.relay_status", lambda: {"cursor": 10, "latest": 5000, "lag": 4990,
                                                            "subscriptions": 0})
    body = client.get("/api/v1/health/").json()
    assert body["failing"] == ["broker", "relay"]
    assert body["broker"] == {"ok": False, "detail": "ConnectionError: broker down"}
    assert body["relay"]["lag"] == 4990 and body["relay"]["ok"] is False
