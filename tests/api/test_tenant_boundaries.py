"""Tenants kept apart: the REST event feed follows the live socket's rule, Idempotency-Keys are
per caller, the API grants no more than the admin, staff usernames stay with staff, anonymous
health answers carry no details."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group, Permission
from rest_framework.authtoken.models import Token

from billing.services import account_topup
from core.models import Membership
from runs import services
from runs.services import escalations
from runs.models import Run
from tests.api.conftest import assert_error, create_run, token_client

pytestmark = pytest.mark.django_db


def member_client(tenant, django_user_model, username: str, *, staff: bool = False, group: str | None = None,
                  role: str = Membership.Role.MEMBER):
    """A user of ``tenant``'s organization (a plain member unless told) and its token client."""
    user = django_user_model.objects.create_user(username=username, is_staff=staff)
    Membership.objects.create(organization=tenant.organization, user=user, role=role)
    if group:
        user.groups.add(Group.objects.get(name=group))
    return user, token_client(Token.objects.create(user=user).key)


# -- the event feed -----------------------------------------------------------------------------------------

def test_a_non_staff_operator_sees_only_its_own_organizations_events(tenant, other, django_user_model):
    create_run(other, name="theirs")
    user, client = member_client(tenant, django_user_model, "a-operator", group="Operators")
    assert user.has_perm("core.view_event")  # the group's permission alone does not open other tenants
    seen = client.get("/api/v1/events/?limit=500").json()["results"]
    assert seen and {event["organization"] for event in seen} == {tenant.organization.pk}
    assert_error(client.get(f"/api/v1/events/?organization={other.organization.pk}"), 404, "not_found")
    assert_error(client.get(f"/api/v1/events/?project={other.project.pk}"), 404, "not_found")


def test_staff_in_the_operators_group_see_every_organizations_events(tenant, other, django_user_model):
    create_run(other, name="theirs")
    _, client = member_client(tenant, django_user_model, "a-staff-operator", staff=True, group="Operators")
    seen = {event["organization"] for event in client.get("/api/v1/events/?limit=500").json()["results"]}
    assert seen == {tenant.organization.pk, other.organization.pk}
    theirs = client.get(f"/api/v1/events/?organization={other.organization.pk}").json()["results"]
    assert theirs and {event["organization"] for event in theirs} == {other.organization.pk}
    # staff without the permission see their own organizations only
    _, plain_staff = member_client(tenant, django_user_model, "plain-staff", staff=True)
    seen = {event["organization"] for event in plain_staff.get("/api/v1/events/?limit=500").json()["results"]}
    assert seen == {tenant.organization.pk}


# -- Idempotency-Key per caller -----------------------------------------------------------------------------

def test_another_caller_of_the_same_organization_with_the_same_key_gets_its_own_request(tenant,
                                                                                      django_user_model):
    _, second = member_client(tenant, django_user_model, "second-caller")
    body = tenant.run_body(name="same body")
    first = tenant.client.post("/api/v1/runs/", body, format="json", HTTP_IDEMPOTENCY_KEY="K")
    assert first.status_code == 201
    mine = second.post("/api/v1/runs/", body, format="json", HTTP_IDEMPOTENCY_KEY="K")
    assert mine.status_code == 201 and "Idempotent-Replayed" not in mine
    assert mine.json()["id"] != first.json()["id"]
    assert Run.objects.count() == 2
    # each caller still gets its own answer replayed, and the 422 for another body is its own
    again = second.post("/api/v1/runs/", body, format="json", HTTP_IDEMPOTENCY_KEY="K")
    assert again["Idempotent-Replayed"] == "true" and again.content == mine.content
    replay = tenant.client.post("/api/v1/runs/", body, format="json", HTTP_IDEMPOTENCY_KEY="K")
    assert replay.content == first.content
    assert_error(second.post("/api/v1/runs/", tenant.run_body(name="another"), format="json",
                             HTTP_IDEMPOTENCY_KEY="K"), 422, "idempotency_key_reused")
    assert Run.objects.count() == 2


def test_a_key_in_flight_is_409_only_for_its_own_caller(tenant, django_user_model):
    from core.api.idempotency import idempotency_claim, request_hash

    body = tenant.run_body(name="in flight")
    import json

    digest = request_hash(method="POST", query_string="", body=json.dumps(body).encode())
    idempotency_claim(organization_id=tenant.organization.pk, user_id=tenant.user.pk, key="F",
                      endpoint="/api/v1/runs/", digest=digest)
    assert_error(tenant.client.post("/api/v1/runs/", body, format="json", HTTP_IDEMPOTENCY_KEY="F"), 409,
                 "idempotency_key_in_use")
    _, second = member_client(tenant, django_user_model, "second-caller")
    assert second.post("/api/v1/runs/", body, format="json", HTTP_IDEMPOTENCY_KEY="F").status_code == 201


# -- no more than the admin -----------------------------------------------------------------------------------

def test_voiding_a_run_needs_the_owner_or_the_void_permission(tenant, django_user_model):
    run = create_run(tenant)
    user, member = member_client(tenant, django_user_model, "plain-member")
    body = assert_error(member.post(f"/api/v1/runs/{run['id']}/void/", {"reason": "mine"}, format="json"), 403,
                        "permission_denied")
    assert body["permission"] == "runs.void_run"
    assert Run.objects.get(pk=run["id"]).status == Run.Status.CREATED
    # the owner, and a member given the permission, reach the service (which refuses a live run)
    assert_error(tenant.client.post(f"/api/v1/runs/{run['id']}/void/", {"reason": "x"}, format="json"), 409,
                 "invalid_transition")
    user.user_permissions.add(Permission.objects.get(content_type__app_label="runs", codename="void_run"))
    member = token_client(Token.objects.get(user=user).key)
    assert_error(member.post(f"/api/v1/runs/{run['id']}/void/", {"reason": "x"}, format="json"), 409,
                 "invalid_transition")


def test_acknowledging_and_resolving_escalations_need_the_owner_or_the_escalation_permission(tenant,
                                                                                             django_user_model):
    run = create_run(tenant)
    ticket, _ = escalations.escalation_open(run=Run.objects.get(pk=run["id"]), trigger="manual", detail="look")
    user, member = member_client(tenant, django_user_model, "plain-member")
    url = f"/api/v1/escalations/{ticket.pk}"
    assert member.get(f"{url}/").status_code == 200  # members may read it
    body = assert_error(member.post(f"{url}/acknowledge/", {}, format="json"), 403, "permission_denied")
    assert body["permission"] == "runs.manage_escalation"
    assert_error(member.post(f"{url}/resolve/", {"reason": "done"}, format="json"), 403, "permission_denied")
    assert tenant.client.get(f"{url}/").json()["status"] == "open"
    user.user_permissions.add(Permission.objects.get(content_type__app_label="runs", codename="manage_escalation"))
    member = token_client(Token.objects.get(user=user).key)
    assert member.post(f"{url}/acknowledge/", {}, format="json").json()["status"] == "acknowledged"
    assert tenant.client.post(f"{url}/resolve/", {"reason": "done"}, format="json").json()["status"] == "resolved"


# -- staff usernames stay with staff ---------------------------------------------------------------------------

@pytest.fixture
def staff_actor(django_user_model):
    """An operator of the console: staff, a member of no tenant."""
    return django_user_model.objects.create_user(username="night-shift-alice", is_staff=True)


def test_escalation_actors_show_as_operator_to_tenants_and_by_name_to_staff(tenant, staff_actor,
                                                                           django_user_model):
    run = create_run(tenant)
    ticket, _ = escalations.escalation_open(run=Run.objects.get(pk=run["id"]), trigger="manual", detail="look")
    escalations.escalation_acknowledge(ticket_id=ticket.pk, actor=staff_actor)
    url = f"/api/v1/escalations/{ticket.pk}/"
    assert tenant.client.get(url).json()["acknowledged_by"] == "operator"
    assert tenant.client.get("/api/v1/escalations/").json()["results"][0]["acknowledged_by"] == "operator"
    assert "night-shift-alice" not in tenant.client.get("/api/v1/events/?limit=500").content.decode()
    _, staff = member_client(tenant, django_user_model, "staff-member", staff=True)
    assert staff.get(url).json()["acknowledged_by"] == "night-shift-alice"
    # a member of the organization is shown by name, staff or not
    user, colleague = member_client(tenant, django_user_model, "colleague", staff=True)
    escalations.escalation_resolve(ticket_id=ticket.pk, actor=user, reason="fixed")
    body = tenant.client.get(url).json()
    assert (body["acknowledged_by"], body["resolved_by"]) == ("operator", "colleague")


def test_ledger_and_run_event_actors_show_as_operator_to_tenants_and_by_name_to_staff(tenant, staff_actor,
                                                                                     django_user_model):
    account_topup(organization_id=tenant.organization.pk, amount=50, reason="goodwill", actor=staff_actor)
    run = create_run(tenant)
    services.run_cancel(run_id=run["id"], actor=staff_actor, reason="stuck")
    entry = tenant.client.get("/api/v1/ledger/?kind=topup").json()["results"][0]
    assert (entry["amount"], entry["actor"]) == (50, "operator")
    assert tenant.client.get(f"/api/v1/ledger/{entry['id']}/").json()["actor"] == "operator"
    cancelled = tenant.client.get(f"/api/v1/runs/{run['id']}/events/").json()["results"][-1]
    assert (cancelled["type"], cancelled["actor"]) == ("run_cancelled", "operator")
    feed = tenant.client.get("/api/v1/events/?limit=500")
    assert "night-shift-alice" not in feed.content.decode()
    mine = [event for event in feed.json()["results"] if event["type"] == "run_created"]
    assert mine[0]["actor"] == tenant.user.username  # the tenant's own people keep their names

    _, staff = member_client(tenant, django_user_model, "staff-member", staff=True)
    assert staff.get(f"/api/v1/ledger/{entry['id']}/").json()["actor"] == "night-shift-alice"
    cancelled = staff.get(f"/api/v1/runs/{run['id']}/events/").json()["results"][-1]
    assert cancelled["actor"] == "night-shift-alice"


def test_who_asked_for_a_suggestion_shows_as_operator_to_tenants(tenant, staff_actor, django_user_model):
    from diagnosis.services import suggestion_request

    run = create_run(tenant)
    suggestion_request(run_id=run["id"], actor=staff_actor)
    url = f"/api/v1/runs/{run['id']}/suggest/"
    assert tenant.client.get(url).json()["suggestion"]["requested_by"] == "operator"
    assert tenant.client.post(url, format="json").json()["suggestion"]["requested_by"] == "operator"  # single flight
    feed = tenant.client.get(f"/api/v1/runs/{run['id']}/events/").json()["results"]
    asked = [event["suggestion"]["requested_by"] for event in feed if event["type"] == "diagnosis_suggestion"]
    assert asked == ["operator"]
    _, staff = member_client(tenant, django_user_model, "staff-member", staff=True)
    assert staff.get(url).json()["suggestion"]["requested_by"] == "night-shift-alice"


# -- health --------------------------------------------------------------------------------------------------

@pytest.fixture
def broken_broker(monkeypatch):
    from jobs.api import views

    def broken():
        raise ConnectionError("redis://:s3cret@10.0.0.7:6379 refused")

    monkeypatch.setitem(views.HEALTH_CHECKS, "broker", broken)


def test_anonymous_health_is_only_the_status(client, broken_broker):
    response = client.get("/api/v1/health/")
    assert response.status_code == 503
    assert response.json() == {"status": "failing"}
    assert "s3cret" not in response.content.decode()
    # wrong credentials change nothing (and are no reason for a 401 here)
    for header in ("Bearer nope", "Token nope", "Basic Zm9vOmJhcg=="):
        response = client.get("/api/v1/health/", HTTP_AUTHORIZATION=header)
        assert (response.status_code, response.json()) == (503, {"status": "failing"}), header


def test_health_details_for_the_metrics_token_and_staff(client, broken_broker, settings, tenant,
                                                        django_user_model):
    settings.ORCHESTRATOR_METRICS_TOKEN = "scrape-token"
    body = client.get("/api/v1/health/", HTTP_AUTHORIZATION="Bearer scrape-token").json()
    assert body["status"] == "failing" and "broker" in body["failing"]
    assert body["broker"] == {"ok": False, "detail": "ConnectionError: redis://:s3cret@10.0.0.7:6379 refused"}
    assert token_client(tenant.token).get("/api/v1/health/").json() == {"status": "failing"}
    staff = django_user_model.objects.create_user(username="staff", is_staff=True)
    client.force_login(staff)
    assert client.get("/api/v1/health/").json()["broker"]["ok"] is False
    staff_token = token_client(Token.objects.create(user=staff).key)
    client.logout()
    assert staff_token.get("/api/v1/health/").json()["broker"]["ok"] is False


# -- requests that wait hold no database connection ------------------------------------------------------------

@pytest.fixture
def sleeps_watched(monkeypatch):
    """Every pause of a waiting request, recorded as whether this thread held a database connection."""
    import time

    from django.db import connection

    held: list[bool] = []
    real_sleep = time.sleep

    def watched(seconds):
        held.append(connection.connection is not None)
        real_sleep(seconds)

    monkeypatch.setattr("jobs.api.views.time.sleep", watched)
    return held


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("endpoint", ["jobs", "suggest"])
def test_a_waiting_request_releases_its_connection_while_it_waits(tenant, settings, sleeps_watched, endpoint):
    settings.ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS = 150  # nobody runs the job: it waits it all out
    if endpoint == "jobs":
        response = tenant.client.post("/api/v1/jobs/", {"type": "noop", "project": tenant.project.pk,
                                                        "payload": {}, "wait_ms": 5_000}, format="json")
    else:
        run = create_run(tenant)
        response = tenant.client.post(f"/api/v1/runs/{run['id']}/suggest/?wait=5", format="json")
    assert response.status_code == 202, response.content
    assert sleeps_watched and not any(sleeps_watched)


def test_a_wait_inside_a_transaction_keeps_its_connection(tenant, settings, sleeps_watched):
    """Inside an atomic block (as this test runs) the connection is the transaction's: it stays."""
    settings.ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS = 50
    response = tenant.client.post("/api/v1/jobs/", {"type": "noop", "project": tenant.project.pk,
                                                    "payload": {}, "wait_ms": 5_000}, format="json")
    assert response.status_code == 202 and sleeps_watched and all(sleeps_watched)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_waiting_request_holds_no_postgres_session(tenant, settings):
    """Seen from the server: while a request waits in another thread, it has no session open."""
    import threading
    import time

    from django.db import connection, connections

    from jobs.models import Job

    settings.ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS = 1_500

    def sessions() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND pid <> pg_backend_pid()")
            return cursor.fetchone()[0]

    baseline = sessions()
    results: list[int] = []

    def waiting_request():
        try:
            client = token_client(tenant.token)
            results.append(client.post("/api/v1/jobs/", {"type": "noop", "project": tenant.project.pk,
                                                         "payload": {}, "wait_ms": 5_000},
                                       format="json").status_code)
        finally:
            connections.close_all()

    thread = threading.Thread(target=waiting_request)
    thread.start()
    seen: list[int] = []
    try:
        deadline = time.monotonic() + 10
        while not Job.objects.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # well into the wait
        while thread.is_alive() and len(seen) < 10:
            seen.append(sessions())
            time.sleep(0.05)
    finally:
        thread.join(15)
    assert results == [202]
    # Between two looks at the job it has no session; a look itself takes a few milliseconds.
    assert len(seen) >= 5 and seen.count(baseline) > len(seen) // 2, (seen, baseline)
