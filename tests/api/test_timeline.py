"""A run's timeline through the API: one item per step try, ordered, paged, tenant-scoped."""

from __future__ import annotations

from datetime import datetime

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing.models import LedgerEntry
from runs import services
from runs.models import Run, StepAttempt
from tests.api.conftest import assert_error, create_run
from tests.conftest import make_plan
from tests.drive import drain_jobs

pytestmark = pytest.mark.django_db(transaction=True)

FLAKY_PLAN = {"agents": [
    {"name": "research", "parallelism_mode": "dag", "tasks": [
        {"name": "fetch", "steps": [{"name": "hello", "tool": "echo", "args": {"text": "hi"}}]},
        {"name": "report", "depends_on": ["fetch"], "steps": [{"name": "summary", "tool": "echo",
                                                                "args": {"text": "done"}}]},
    ]},
    {"name": "drill", "failure_mode": "continue", "tasks": [
        {"name": "flaky", "steps": [{"name": "flaky", "tool": "fail", "args": {"mode": "retryable", "times": 1}}]},
    ]},
]}


def timeline(tenant, run_id: int, **params):
    return tenant.client.get(f"/api/v1/runs/{run_id}/timeline/", params)


def finished_run(tenant, plan: dict) -> Run:
    body = create_run(tenant, plan=plan)
    services.run_start(run_id=body["id"])
    drain_jobs(until=lambda: Run.objects.get(pk=body["id"]).status in (Run.Status.COMPLETED, Run.Status.FAILED),
               timeout=30)
    return Run.objects.get(pk=body["id"])


def test_one_item_per_try_ordered_with_the_retry_as_its_own_item(tenant):
    run = finished_run(tenant, FLAKY_PLAN)
    assert run.status == Run.Status.COMPLETED

    response = timeline(tenant, run.pk)
    assert response.status_code == 200
    body = response.json()
    assert (body["run"], body["status"], body["attempt_number"], body["next"]) == (run.pk, "completed", 1, None)
    assert body["credits"] == {"limit": run.credit_limit, "reserved": run.credits_reserved,
                               "charged": run.credits_charged, "refunded": run.credits_refunded}
    items = body["items"]
    assert body["count"] == len(items) == StepAttempt.objects.filter(run=run).count() == 4
    keys = [(datetime.fromisoformat(item["started_at"].replace("Z", "+00:00")), item["id"]) for item in items]
    assert keys == sorted(keys)
    flaky = [item for item in items if item["step"]["name"] == "flaky"]
    assert [(item["try"], item["status"], item["error_code"], item["retryable"]) for item in flaky] == [
        (1, "failed", "drill_retryable", True), (2, "succeeded", "", None)]
    assert {(item["agent"]["name"], item["task"]["name"]) for item in flaky} == {("drill", "flaky")}
    summary = next(item for item in items if item["step"]["name"] == "summary")
    assert summary["step"] == {"id": summary["step"]["id"], "name": "summary", "kind": "tool", "tool": "echo"}
    assert summary["attempt"] == 1 and summary["try"] == 1 and summary["status"] == "succeeded"
    for item in items:
        assert item["finished_at"] and item["duration_ms"] >= 0
    # credits: what each try was charged, summing to the run's charges
    charged = {entry.idempotency_key: -entry.amount if entry.amount < 0 else entry.amount
               for entry in LedgerEntry.objects.filter(run_id=run.pk, kind="charge")}
    by_id = {attempt.pk: attempt.idempotency_key for attempt in StepAttempt.objects.filter(run=run)}
    for item in items:
        assert item["credits"] == charged.get(by_id[item["id"]], 0) == 1
    assert sum(item["credits"] for item in items) == run.credits_charged


def test_a_failed_run_shows_its_error_codes_and_a_second_attempt_separately(tenant):
    plan = make_plan(tool="fail", args={"mode": "fatal"})
    run = finished_run(tenant, plan)
    assert run.status == Run.Status.FAILED
    services.run_retry(run_id=run.pk, reason="again")
    drain_jobs(until=lambda: Run.objects.get(pk=run.pk).status == Run.Status.FAILED, timeout=30)

    items = timeline(tenant, run.pk).json()["items"]
    assert [(item["attempt"], item["try"], item["status"], item["error_code"]) for item in items] == [
        (1, 1, "failed", "drill_fatal"), (2, 1, "failed", "drill_fatal")]
    assert items[0]["step"]["id"] != items[1]["step"]["id"]  # each attempt has its own tree


def test_a_running_try_has_no_finish_and_no_duration(tenant):
    body = create_run(tenant)
    services.run_start(run_id=body["id"])
    services.run_mark_running(run_id=body["id"])
    step = Run.objects.get(pk=body["id"]).steps.get()
    services.step_begin(step_id=step.pk)
    (item,) = timeline(tenant, body["id"]).json()["items"]
    assert (item["status"], item["finished_at"], item["duration_ms"], item["credits"]) == ("running", None, None, 0)


def test_pages_follow_the_cursor_and_unknown_parameters_are_harmless(tenant):
    run = finished_run(tenant, make_plan(steps=7))
    whole = timeline(tenant, run.pk, nonsense="1", ordering="-id").json()
    assert whole["count"] == 7 and len(whole["items"]) == 7
    with CaptureQueriesContext(connection) as one:
        assert len(timeline(tenant, run.pk, limit=1).json()["items"]) == 1
    with CaptureQueriesContext(connection) as seven:
        assert len(timeline(tenant, run.pk).json()["items"]) == 7
    assert len(seven) == len(one)  # the tries, with their step, task and agent, in one query

    seen, url = [], None
    response = timeline(tenant, run.pk, limit=3)
    while True:
        body = response.json()
        assert body["count"] == 7 and len(body["items"]) <= 3
        seen += [item["id"] for item in body["items"]]
        url = body["next"]
        if url is None:
            break
        assert "limit=3" in url
        response = tenant.client.get(url)
    assert seen == [item["id"] for item in whole["items"]]

    for params in ({"limit": 0}, {"limit": 2001}, {"limit": "x"}, {"cursor": "not-a-cursor"}):
        body = assert_error(timeline(tenant, run.pk, **params), 400, "validation_error")
        assert set(body["errors"]) == set(params)


def test_another_organizations_run_and_a_missing_one_answer_404(tenant, other):
    run = finished_run(tenant, make_plan())
    assert_error(timeline(other, run.pk), 404, "not_found")
    assert_error(timeline(tenant, 2**62), 404, "not_found")
    assert_error(timeline(tenant, "abc"), 404, "not_found")
    services.run_create(project=other.project, name="theirs", plan=make_plan())
    theirs = Run.objects.get(name="theirs")
    assert_error(timeline(tenant, theirs.pk), 404, "not_found")
    assert timeline(other, theirs.pk).json()["items"] == []
