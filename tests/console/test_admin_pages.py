"""The console's pages under load: changelist and run page queries stay fixed as rows grow,
the stuck-job filter, and the history of runbook actions."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from runs import services
from runs.models import Run
from tests.conftest import make_plan, run_ticked
from tests.console.conftest import build_run

pytestmark = pytest.mark.django_db


def changelist(model: str) -> str:
    app_label, model_name = model.split(".")
    return reverse(f"admin:{app_label}_{model_name}_changelist")


def listed_ids(response) -> set[int]:
    return {obj.pk for obj in response.context["cl"].result_list}


def test_job_filter_stuck_finds_an_expired_lease(viewer_client, job_in, settings):
    job = job_in("executing")
    url = changelist("jobs.job")
    assert listed_ids(viewer_client.get(url, {"stuck": "lease_expired"})) == set()
    settings.ORCHESTRATOR_QUEUE_LEASE_S = -60  # a claim made now would already have expired
    expired = job_in("executing")
    assert listed_ids(viewer_client.get(url, {"stuck": "lease_expired"})) == {expired.pk}
    assert job.pk in listed_ids(viewer_client.get(url, {"state__exact": "executing"}))
    assert viewer_client.get(url, {"stuck": "starved"}).status_code == 200


def _changelist_queries(client) -> tuple[int, int]:
    with CaptureQueriesContext(connection) as queries:
        response = client.get(changelist("runs.run"), {"rows": 100})  # 50 by default; 100 rows shown here
    assert response.status_code == 200
    return len(queries), len(response.context["cl"].result_list)


def test_run_changelist_query_count_is_the_same_for_10_and_1000_runs(viewer_client, run_in, escalation, project):
    runs = [run_in(state) for state in ("created", "pending", "running", "paused", "failed", "completed",
                                        "cancelled", "retrying", "resuming", "awaiting_approval")]
    escalation(runs[2])
    ten, shown = _changelist_queries(viewer_client)
    assert shown == 10
    template = runs[0]
    Run.objects.bulk_create([  # created is the default state: no transition is skipped
        Run(organization_id=template.organization_id, project=project, name=f"bulk {index}", plan=template.plan,
            credit_limit=template.credit_limit, status_changed_at=template.status_changed_at)
        for index in range(990)
    ], batch_size=500)
    thousand, shown = _changelist_queries(viewer_client)
    assert shown == 100  # one page
    assert thousand == ten
    with CaptureQueriesContext(connection) as queries:
        assert viewer_client.get(changelist("runs.run"), {"stuck": "yes", "escalated": "yes",
                                                          "q": "bulk"}).status_code == 200
    assert len(queries) == ten


def test_run_page_shows_the_tree_timeline_audit_and_inlines_in_fixed_queries(viewer_client, project, escalation,
                                                                            operator):
    small = build_run(project, "running", name="small")
    services.run_pause(run_id=small.pk, actor=operator, reason="look closer")
    escalation(small)
    big = services.run_create(project=project, name="big", plan=make_plan(agents=4, tasks=3, steps=3))
    services.run_start(run_id=big.pk)
    run_ticked(big.pk)
    services.run_fail(run_id=big.pk, code="worker_lost", message="gone")
    services.run_retry(run_id=big.pk, actor=operator, reason="try again")
    services.run_requeue(run_id=big.pk)
    run_ticked(big.pk)

    def page(run):
        with CaptureQueriesContext(connection) as queries:
            response = viewer_client.get(reverse("admin:runs_run_change", args=[run.pk]))
        assert response.status_code == 200
        return response, len(queries)

    page(small)  # warm the per-process caches (content types for the inlines' change links)
    response, small_queries = page(small)
    html = response.content.decode()
    for text in ("agent a0", "task t0", "step s0", "[completed]", "step s1", "Attempt 1 (current)",
                 "run_paused", "look closer", "run_pause", "needs a look", "attempt:1:reserve",
                 'data-live="run-status"', 'data-live="heartbeat"', "all events of this run"):
        assert text in html, text
    response, big_queries = page(big)
    html = response.content.decode()
    assert "Attempt 2 (current)" in html and "Attempt 1" in html and "agent a3" in html
    assert html.count("step s2") == 2 * 4 * 3  # both attempts' trees
    assert big_queries == small_queries


def test_the_history_of_a_run_shows_runbook_log_entries(login, make_staff, run_in):
    run = run_in("running")
    client = login(make_staff("ff", "runs.force_fail_run"))
    client.post(changelist("runs.run"), {"action": "force_fail", "_selected_action": [run.pk],
                                         "runbook_confirm": "force_fail", "reason": "wedged"})
    entry = LogEntry.objects.get(object_id=str(run.pk))
    history = client.get(reverse("admin:runs_run_history", args=[run.pk]))
    assert history.status_code == 200 and entry.change_message in history.content.decode()


def test_a_run_of_many_charges_shows_its_latest_ledger_entries_and_links_to_all(viewer_client, project):
    from billing.models import LedgerEntry
    from runs.models import Step

    run = services.run_create(project=project, name="many charges", plan=make_plan(steps=60))
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    for step in Step.objects.filter(run=run).order_by("sequence")[:55]:
        services.step_attempt_succeed(attempt_id=services.step_begin(step_id=step.pk).pk, output={"ok": True})
    total = LedgerEntry.objects.filter(run=run).count()
    assert total > 50

    with CaptureQueriesContext(connection) as queries:
        html = viewer_client.get(reverse("admin:runs_run_change", args=[run.pk])).content.decode()
    assert html.count("<tr>", html.index('class="run-ledger"'), html.index("all ledger entries of this run")) == 51
    assert "the latest 50; " in html and "attempt:1:reserve" not in html  # the oldest entry is on the full list
    assert len(queries) < 40
    other = build_run(project, "completed", name="elsewhere")
    listing = viewer_client.get(reverse("admin:billing_ledgerentry_changelist"), {"run__id__exact": run.pk})
    assert listing.status_code == 200
    assert {entry.run_id for entry in listing.context["cl"].result_list} == {run.pk}
    assert listing.context["cl"].result_count == total and other.pk != run.pk
