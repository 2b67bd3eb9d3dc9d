"""Runbooks over a whole filter: the commands' ``--filter`` (a dry run first) and the admin's
"select all" beyond its page cap, both as a tracked bulk operation (counts, an audit record per
object, abort, a redelivered processing job)."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.urls import reverse

from core.bulk import bulk_operation_abort, bulk_operation_process, bulk_operation_start
from core.models import AuditRecord, BulkOperation, Event
from core.runbooks import runbook_get
from core.services import project_create
from jobs import tasks
from runs.models import Run
from tests.console.test_actions import changelist

pytestmark = pytest.mark.django_db


def created_runs(template: Run, project, count: int, *, name: str = "bulk") -> list[int]:
    """``count`` created runs like ``template`` (created is the default state: no transition is skipped)."""
    runs = Run.objects.bulk_create([
        Run(organization_id=template.organization_id, project=project, name=f"{name} {index}", plan=template.plan,
            credit_limit=template.credit_limit, status_changed_at=template.status_changed_at)
        for index in range(count)
    ], batch_size=500)
    return [run.pk for run in runs]


@pytest.fixture
def sent(monkeypatch):
    """The django-q2 messages the bulk launcher sends (nothing reaches a broker here)."""
    messages = []
    monkeypatch.setattr("django_q.tasks.async_task", lambda func, *args, **kwargs: messages.append((func, args)))
    return messages


def test_cancel_run_with_a_filter_dry_runs_then_cancels_every_matching_run_with_an_audit_record_each(
        run_in, project):
    template = run_in("created")
    other_project = project_create(organization=project.organization, name="other")
    matching = [template.pk, *created_runs(template, project, 599)]
    elsewhere = created_runs(template, other_project, 5)
    running = run_in("running")
    query = f"status__exact=created&project__id__exact={project.pk}"

    out = StringIO()
    call_command("cancel_run", "--filter", query, "--reason", "cleanup", "--dry-run", stdout=out)
    text = out.getvalue()
    assert text.startswith(f"600 runs match --filter {query!r}")
    assert "dry run: run" in text and "created → cancelled" in text and "credits" in text
    assert "600 planned" in text
    assert not Run.objects.filter(status="cancelled").exists() and not BulkOperation.objects.exists()

    out = StringIO()
    call_command("cancel_run", "--filter", query, "--reason", "cleanup", "--json", stdout=out)
    report = json.loads(out.getvalue())
    assert (report["matched"], report["done"], report["refused"]) == (600, 600, 0)
    assert set(Run.objects.filter(pk__in=matching).values_list("status", flat=True)) == {"cancelled"}
    assert set(Run.objects.filter(pk__in=elsewhere).values_list("status", flat=True)) == {"created"}
    assert Run.objects.get(pk=running.pk).status == "running"
    operation = BulkOperation.objects.get(pk=report["operation"])
    assert (operation.status, operation.total, operation.done, operation.skipped, operation.refused) == (
        "finished", 600, 600, 0, 0)
    assert operation.runbook == "runs.run.cancel" and operation.actor_label.startswith("shell:")
    audits = AuditRecord.objects.filter(action="run_cancel")
    assert sorted(int(pk) for pk in audits.values_list("target_id", flat=True)) == sorted(matching)
    assert {reason for reason in audits.values_list("reason", flat=True)} == {
        f"cleanup (bulk operation {operation.pk})"}
    assert Event.objects.filter(type="bulk_operation_progress").count() == 1 + 6 + 1  # start, 6 batches, finish

    out = StringIO()  # the same filter again: nothing matches any more
    call_command("cancel_run", "--filter", query, "--reason", "again", stdout=out)
    assert out.getvalue().startswith("0 runs match")


def test_filter_means_what_the_admin_list_means_list_filters_and_searches(run_in, settings):
    settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S = 0  # a running run is stuck at once
    stuck = run_in("running", name="stuck one")
    run_in("running", name="fine one")
    created = run_in("created", name="stuck too but created")
    out = StringIO()
    call_command("force_fail_run", "--filter", "stuck=yes&q=stuck", "--reason", "r", "--dry-run", "--json",
                 stdout=out)
    report = json.loads(out.getvalue())
    assert report["matched"] == 1 and [row["run"] for row in report["results"]] == [stuck.pk]
    assert created.pk not in [row["run"] for row in report["results"]]
    out = StringIO()  # a pasted changelist URL, with its paging and ordering
    call_command("force_fail_run", "--filter", "/admin/runs/run/?q=one&o=1&p=3", "--reason", "r", "--dry-run",
                 stdout=out)
    assert out.getvalue().startswith("2 runs match")


@pytest.mark.parametrize("args, message", [
    (["--filter", "nope=1"], "invalid filter"),
    (["--filter", "status__exact=created", "1"], "not both"),
    (["--filter", "id__in=a,b"], "invalid filter"),
    (["--filter", "x" * 5000], "at most 4000 characters"),
    ([], "give run ids, or --filter"),
])
def test_bad_filters_are_clear_errors(db, args, message):
    with pytest.raises(CommandError, match=message):
        call_command("cancel_run", *args, "--reason", "r", stdout=StringIO(), stderr=StringIO())


def test_select_all_beyond_the_page_cap_runs_as_a_tracked_bulk_operation_in_the_background(
        make_staff, login, run_in, project, sent, django_capture_on_commit_callbacks):
    client = login(make_staff("op", "runs.cancel_run"))
    template = run_in("created")
    ids = [template.pk, *created_runs(template, project, 549)]
    done_already = run_in("completed")
    url = changelist() + "?status__exact=created"
    select_all = {"action": "cancel", "_selected_action": ids[:100], "select_across": "1", "index": "0"}
    page = client.post(url, select_all)
    assert page.status_code == 200 and page.context["bulk_total"] == 550
    assert 'data-bulk-total="550"' in page.content.decode()
    assert not BulkOperation.objects.exists()

    confirm = {"action": "cancel", "_selected_action": ids[:25], "select_across": "1", "runbook_confirm": "cancel"}
    page = client.post(url, {**confirm, "reason": ""})
    assert "A reason is required." in page.content.decode() and not BulkOperation.objects.exists()
    with django_capture_on_commit_callbacks(execute=True):
        with_reason = client.post(url, {**confirm, "reason": "incident 42"})
    operation = BulkOperation.objects.get()
    assert with_reason.status_code == 302
    assert with_reason["Location"] == reverse("admin:core_bulkoperation_change", args=[operation.pk])
    assert (operation.total, operation.query, operation.actor_label) == (550, "status__exact=created", "op")
    assert sent == [("jobs.tasks.bulk_runbook", (operation.pk,))]
    assert not Run.objects.filter(status="cancelled").exists()  # nothing yet: the job does it

    delivered = 0
    while delivered < len(sent):  # each message delivered once, as a worker runs the django-q2 task (it
        delivered += 1            # sends itself again when its drain budget ends before the operation)
        tasks.bulk_runbook(operation.pk)
    operation.refresh_from_db()
    assert (operation.status, operation.done, operation.skipped, operation.refused) == ("finished", 550, 0, 0)
    assert set(Run.objects.filter(pk__in=ids).values_list("status", flat=True)) == {"cancelled"}
    assert Run.objects.get(pk=done_already.pk).status == "completed"
    audits = AuditRecord.objects.filter(action="run_cancel", actor_label="op")
    assert audits.count() == 550 and {int(pk) for pk in audits.values_list("target_id", flat=True)} == set(ids)

    tasks.bulk_runbook(operation.pk)  # delivered again: nothing more happens, nothing is counted twice
    operation.refresh_from_db()
    assert (operation.done, AuditRecord.objects.filter(action="run_cancel").count()) == (550, 550)

    progress = client.get(reverse("admin:core_bulkoperation_progress", args=[operation.pk])).json()
    assert (progress["status"], progress["processed"], progress["total"]) == ("finished", 550, 550)
    detail = client.get(reverse("admin:core_bulkoperation_change", args=[operation.pk])).content.decode()
    assert 'id="bulk-progress"' in detail and "data-bulk-abort" not in detail  # finished: no Abort button


def test_an_operation_is_aborted_between_batches_from_its_page(make_staff, login, run_in, project, sent):
    operator = make_staff("op", "runs.cancel_run")
    client = login(operator)
    template = run_in("created")
    ids = [template.pk, *created_runs(template, project, 299)]
    runbook = runbook_get(Run, "cancel")
    operation = bulk_operation_start(runbook=runbook, query="status__exact=created", actor=operator, reason="r")
    page = client.get(reverse("admin:core_bulkoperation_change", args=[operation.pk])).content.decode()
    assert f'data-bulk-abort="{operation.pk}"' in page
    assert login(make_staff("viewer")).post(reverse("admin:core_bulkoperation_abort", args=[operation.pk])
                                            ).status_code == 403

    def abort_after_the_first_batch(outcomes):
        response = client.post(reverse("admin:core_bulkoperation_abort", args=[operation.pk]))
        assert response.status_code == 302

    operation = bulk_operation_process(operation_id=operation.pk, batch_size=100,
                                       on_outcomes=abort_after_the_first_batch)
    assert (operation.status, operation.done, operation.abort_requested_by) == ("aborted", 100, "op")
    assert Run.objects.filter(pk__in=ids, status="cancelled").count() == 100
    assert Run.objects.filter(pk__in=ids, status="created").count() == 200
    assert AuditRecord.objects.filter(action="bulk_operation_abort", actor=operator).count() == 1
    with pytest.raises(Exception, match="nothing to abort"):
        bulk_operation_abort(operation_id=operation.pk, actor=operator)
    tasks.bulk_runbook(operation.pk)  # a late delivery of an aborted operation changes nothing
    assert Run.objects.filter(pk__in=ids, status="cancelled").count() == 100


def test_refusals_and_skips_are_counted_per_object(run_in, project):
    created = run_in("created")
    completed = run_in("completed")
    failed = run_in("failed")
    operation = bulk_operation_start(runbook=runbook_get(Run, "pause"), query="", actor=None, reason="r")
    operation = bulk_operation_process(operation_id=operation.pk)
    assert operation.total == 3 and operation.status == "finished"
    assert (operation.done, operation.skipped, operation.refused) == (0, 2, 1)
    assert [row["id"] for row in operation.refusals] == [created.pk]
    assert {completed.pk, failed.pk}.isdisjoint(row["id"] for row in operation.refusals)
