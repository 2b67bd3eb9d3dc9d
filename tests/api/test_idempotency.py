"""Idempotency-Key on POSTs: replay byte for byte with a single effect, 422 on another body,
409 while in flight, per-organization and per-caller keys, takeover of abandoned keys, expiry, concurrency."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection, connections
from django.test import override_settings
from django.utils import timezone

from billing.models import LedgerEntry
from core.api.idempotency import idempotency_claim, request_hash
from core.models import IdempotencyRecord, Membership
from jobs.models import Job
from runs.models import Run
from tests.api.conftest import assert_error, create_run, token_client

pytestmark = pytest.mark.django_db


def post(tenant, path, body, key, client=None):
    return (client or tenant.client).post(path, body, format="json", HTTP_IDEMPOTENCY_KEY=key)


def test_the_same_key_and_body_replay_the_stored_response_byte_for_byte_with_one_effect(tenant):
    body = tenant.run_body(name="once")
    first = post(tenant, "/api/v1/runs/", body, "key-1")
    assert first.status_code == 201
    second = post(tenant, "/api/v1/runs/", body, "key-1")
    assert second.status_code == 201 and second.content == first.content
    assert second["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first
    # the JSON's key order does not matter: it is the same body
    reordered = json.dumps(dict(reversed(list(body.items()))))
    third = tenant.client.post("/api/v1/runs/", reordered, content_type="application/json",
                               HTTP_IDEMPOTENCY_KEY="key-1")
    assert third.content == first.content
    assert Run.objects.count() == 1
    record = IdempotencyRecord.objects.get()
    assert (record.status, record.response_status, record.endpoint) == ("done", 201, "/api/v1/runs/")
    assert timedelta(hours=23) < record.expires_at - record.created_at <= timedelta(hours=24)


def test_replays_even_after_the_state_moved_on(tenant):
    run = create_run(tenant)
    first = post(tenant, f"/api/v1/runs/{run['id']}/start/", {}, "start-1")
    tenant.client.post(f"/api/v1/runs/{run['id']}/cancel/", format="json")
    again = post(tenant, f"/api/v1/runs/{run['id']}/start/", {}, "start-1")
    assert again.status_code == 200 and again.content == first.content and again.json()["status"] == "pending"
    assert LedgerEntry.objects.filter(run_id=run["id"], kind="reserve").count() == 1


def test_a_job_enqueued_with_a_key_is_enqueued_once(tenant):
    body = {"type": "noop", "project": tenant.project.pk, "payload": {"value": 1}}
    first = post(tenant, "/api/v1/jobs/", body, "job-1")
    second = post(tenant, "/api/v1/jobs/", body, "job-1")
    assert (first.status_code, second.status_code) == (202, 202) and first.content == second.content
    assert Job.objects.count() == 1
    assert post(tenant, "/api/v1/jobs/", body, "job-2").status_code == 202
    assert Job.objects.count() == 2


def test_the_same_key_with_another_body_is_422(tenant):
    post(tenant, "/api/v1/runs/", tenant.run_body(name="a"), "key-1")
    assert_error(post(tenant, "/api/v1/runs/", tenant.run_body(name="b"), "key-1"), 422, "idempotency_key_reused")
    assert Run.objects.count() == 1


def test_keys_are_per_endpoint(tenant):
    run = create_run(tenant)
    assert post(tenant, f"/api/v1/runs/{run['id']}/start/", {}, "k").status_code == 200
    assert post(tenant, "/api/v1/runs/", tenant.run_body(), "k").status_code == 201
    assert IdempotencyRecord.objects.count() == 2


def test_one_organizations_key_never_answers_another(tenant, other):
    mine = post(tenant, "/api/v1/runs/", tenant.run_body(), "shared-key")
    theirs = post(other, "/api/v1/runs/", other.run_body(), "shared-key")
    assert (mine.status_code, theirs.status_code) == (201, 201) and mine.json()["id"] != theirs.json()["id"]
    # one user in both organizations: the same key in each organization is two keys (and the
    # other organization's owner's use of it is not this caller's)
    Membership.objects.create(organization=other.organization, user=tenant.user)
    in_other = post(tenant, "/api/v1/runs/", other.run_body(name="x"), "shared-key")
    assert in_other.status_code == 201 and in_other.json()["organization"] == other.organization.pk
    assert post(tenant, "/api/v1/runs/", other.run_body(name="x"), "shared-key").content == in_other.content
    assert_error(post(tenant, "/api/v1/runs/", other.run_body(name="y"), "shared-key"), 422,
                 "idempotency_key_reused")
    assert Run.objects.count() == 3


def _claim_in_flight(tenant, path: str, body: dict, key: str):
    digest = request_hash(method="POST", query_string="", body=json.dumps(body).encode())
    return idempotency_claim(organization_id=tenant.organization.pk, user_id=tenant.user.pk, key=key, endpoint=path,
                             digest=digest)


def test_a_key_in_flight_is_409_then_an_abandoned_one_is_taken_over(tenant, settings):
    body = tenant.run_body()
    _claim_in_flight(tenant, "/api/v1/runs/", body, "busy")
    body_409 = assert_error(post(tenant, "/api/v1/runs/", body, "busy"), 409, "idempotency_key_in_use")
    assert body_409["key"] == "busy"
    assert Run.objects.count() == 0
    IdempotencyRecord.objects.update(locked_at=timezone.now() - timedelta(
        seconds=settings.ORCHESTRATOR_IDEMPOTENCY_IN_FLIGHT_TIMEOUT_S + 1))
    taken = post(tenant, "/api/v1/runs/", body, "busy")
    assert taken.status_code == 201 and Run.objects.count() == 1
    assert post(tenant, "/api/v1/runs/", body, "busy").content == taken.content


def test_an_expired_key_is_as_if_absent(tenant):
    post(tenant, "/api/v1/runs/", tenant.run_body(name="old"), "k")
    IdempotencyRecord.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    response = post(tenant, "/api/v1/runs/", tenant.run_body(name="new"), "k")
    assert response.status_code == 201 and response.json()["name"] == "new"
    assert IdempotencyRecord.objects.get().expires_at > timezone.now()


def test_try_again_answers_are_not_stored(tenant, settings):
    body = {"type": "noop", "project": tenant.project.pk, "payload": {}}
    with override_settings(ORCHESTRATOR_QUEUE_MAX_PER_PROJECT=0):
        assert_error(post(tenant, "/api/v1/jobs/", body, "later"), 429, "queue_full")
    assert IdempotencyRecord.objects.count() == 0
    assert post(tenant, "/api/v1/jobs/", body, "later").status_code == 202


def test_final_errors_are_stored_and_replayed(tenant_factory):
    poor = tenant_factory(credits=1)
    first = post(poor, "/api/v1/runs/", poor.run_body(credit_limit=5), "k")
    assert_error(first, 402, "insufficient_credits")
    again = post(poor, "/api/v1/runs/", poor.run_body(credit_limit=5), "k")
    assert again.status_code == 402 and again.content == first.content and again["Idempotent-Replayed"] == "true"


def test_requests_that_name_no_organization_are_not_keyed(tenant):
    assert_error(post(tenant, "/api/v1/runs/", {"name": "no project"}, "k"), 400, "validation_error")
    assert IdempotencyRecord.objects.count() == 0
    assert_error(post(tenant, "/api/v1/runs/", tenant.run_body(project=99999), "k"), 404, "not_found")
    assert IdempotencyRecord.objects.count() == 0


@pytest.mark.parametrize("key", ["", "x" * 256, "ключ", "tab\there"])
def test_a_malformed_key_is_400(tenant, key):
    response = tenant.client.post("/api/v1/runs/", tenant.run_body(), format="json",
                                  headers={"Idempotency-Key": key})
    body = assert_error(response, 400, "validation_error")
    assert "Idempotency-Key" in body["errors"]
    assert Run.objects.count() == 0


def test_a_crash_releases_the_key(tenant, monkeypatch):
    from runs import services

    def boom(**kwargs):
        raise RuntimeError("bug")

    monkeypatch.setattr(services, "run_create", boom)
    tenant.client.raise_request_exception = True
    with pytest.raises(RuntimeError):
        post(tenant, "/api/v1/runs/", tenant.run_body(), "k")
    assert IdempotencyRecord.objects.count() == 0


def test_prune_idempotency_deletes_expired_records(tenant):
    post(tenant, "/api/v1/runs/", tenant.run_body(), "old")
    post(tenant, "/api/v1/runs/", tenant.run_body(name="b"), "new")
    IdempotencyRecord.objects.filter(key="old").update(expires_at=timezone.now() - timedelta(minutes=1))
    out = StringIO()
    call_command("prune_idempotency", stdout=out)
    assert "deleted 1 expired" in out.getvalue()
    assert list(IdempotencyRecord.objects.values_list("key", flat=True)) == ["new"]


def _hammer(tenant, count: int) -> list[tuple[int, bytes]]:
    """``count`` threads, each with its own connection, post one key at the same moment."""
    barrier = threading.Barrier(count)
    results: list[tuple[int, bytes]] = []
    lock = threading.Lock()
    body = tenant.run_body(name="concurrent")

    def one():
        try:
            client = token_client(tenant.token)
            barrier.wait(timeout=30)
            response = client.post("/api/v1/runs/", body, format="json", HTTP_IDEMPOTENCY_KEY="same-key")
            with lock:
                results.append((response.status_code, response.content))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def _assert_one_run(results, count):
    assert len(results) == count
    statuses = {status for status, _ in results}
    assert statuses <= {201, 409}, statuses
    created = {content for status, content in results if status == 201}
    assert len(created) == 1  # every 201 is the same bytes: the first answer or its replay
    for status, content in results:
        if status == 409:
            assert json.loads(content)["code"] == "idempotency_key_in_use"
    assert Run.objects.count() == 1
    assert IdempotencyRecord.objects.get().status == "done"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_fifty_concurrent_requests_with_one_key_create_one_run_on_postgres(tenant):
    assert connection.vendor == "postgresql"
    _assert_one_run(_hammer(tenant, 50), 50)


@pytest.mark.django_db(transaction=True)
def test_concurrent_requests_with_one_key_create_one_run(tenant):
    _assert_one_run(_hammer(tenant, 8), 8)


def test_a_request_whose_key_was_taken_over_meanwhile_changes_nothing(tenant, monkeypatch):
    """A request slower than the in-flight timeout loses its key to a retry: its effect is undone."""
    from runs import services

    real_create = services.run_create

    def slow_create(**kwargs):
        run = real_create(**kwargs)
        IdempotencyRecord.objects.update(lock_token="another-request")  # the retry took it over
        return run

    monkeypatch.setattr(services, "run_create", slow_create)
    assert_error(post(tenant, "/api/v1/runs/", tenant.run_body(), "slow"), 409, "idempotency_key_in_use")
    assert Run.objects.count() == 0
    assert IdempotencyRecord.objects.get().status == "in_flight"  # the owner's, untouched
