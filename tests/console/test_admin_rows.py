"""The large lists' rows (``core.admin_rows``): the same HTML as Django's own rendering, cell for
cell, at a fraction of its cost; and what an operator reads in the run and job lists."""

from __future__ import annotations

import pytest
from django.contrib.admin.templatetags.admin_list import items_for_result
from django.urls import reverse
from django.utils import timezone

from core.admin_rows import duration_label, rows_html
from runs.models import Run
from tests.console.conftest import build_run

pytestmark = pytest.mark.django_db

SCALED_LISTS = ["runs_run", "jobs_job", "billing_ledgerentry", "core_event", "core_auditrecord"]


def _rows(viewer_client, name: str, params: dict | None = None):
    response = viewer_client.get(reverse(f"admin:{name}_changelist"), params or {})
    assert response.status_code == 200
    cl = response.context["cl"]
    return response, cl


@pytest.mark.parametrize("name", SCALED_LISTS)
def test_rows_are_the_stock_html_cell_for_cell(viewer_client, project, job_in, name, monkeypatch):
    for state in ("running", "failed", "paused", "completed"):
        build_run(project, state, name=f"<b>{state}</b> & a long name that an operator needs to see whole")
    job_in("executing")
    job_in("queued")
    now = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: now)  # the ages drawn twice must be the same
    for params in ({}, {"o": "-1"}, {"status__exact": "failed"} if name == "runs_run" else {"q": "x"}):
        response, cl = _rows(viewer_client, name, params)
        ours = rows_html(cl)
        assert ours is not None and len(ours) == len(cl.result_list)
        if name != "core_auditrecord":
            assert cl.result_list or params, name  # the setup wrote rows of every list
        for row, html in zip(cl.result_list, ours):
            assert html == "".join(items_for_result(cl, row, None)), (name, params)
            assert html in response.content.decode()


def test_the_run_list_shows_what_an_incident_needs(viewer_client, project):
    run = build_run(project, "failed", name="a run whose name is far too long to fit in its column " * 3)
    Run.objects.filter(pk=run.pk).update(last_error_code="upstream_timeout", last_error="the upstream took 31 s",
                                         status_reason="retries_exhausted")
    page = viewer_client.get(reverse("admin:runs_run_changelist")).content.decode()
    row = page[page.index(reverse("admin:runs_run_change", args=[run.pk])):]
    row = row[:row.index("</tr>")]
    run.refresh_from_db()
    assert 'class="cell-truncate" title="a run whose name is far too long' in row  # cut, whole in the title
    assert 'data-live="run-status"' in row and "retries_exhausted" in row
    assert "upstream_timeout" in row and 'title="the upstream took 31 s"' in row
    assert f"{run.attempt_number}/{run.max_attempts}" in row
    assert f"{run.credits_charged} / {run.credit_limit}" in row
    assert f'title="{run.project}">{run.project.name}</span>' in row
    for header in ("status · reason", "last error", "in status", "duration", "attempt", "credits charged / limit",
                   "project"):
        assert header.capitalize() in page


def test_the_job_list_shows_state_reason_type_lane_attempts_wait_and_run(viewer_client, project, job_in):
    job = job_in("executing")
    page = viewer_client.get(reverse("admin:jobs_job_changelist")).content.decode()
    row = page[page.index(reverse("admin:jobs_job_change", args=[job.pk])):]
    row = row[:row.index("</tr>")]
    assert 'data-live="job-state"' in row and job.state in row
    assert job.type in row and f"{job.attempts}/{job.max_attempts}" in row
    if job.reason:
        assert job.reason in row
    if job.run_id:
        assert reverse("admin:runs_run_change", args=[job.run_id]) in row
    for header in ("State · reason", "Type", "Lane", "Attempts", "Wait", "Run"):
        assert f">{header}<" in page


def test_durations_are_compact():
    assert [duration_label(value) for value in (None, 0, 59, 60, 3599, 3600, 3660, 86400, 90000)] == [
        "—", "0s", "59s", "1m", "59m", "1h", "1h 1m", "1d", "1d 1h"]



def test_a_page_shows_50_rows_and_per_page_shows_more_kept_in_its_links(viewer_client, project):
    template = build_run(project, "created", name="template")
    Run.objects.bulk_create([Run(organization_id=template.organization_id, project=project, name=f"bulk {index}",
                                 plan=template.plan, credit_limit=template.credit_limit) for index in range(119)])
    url = reverse("admin:runs_run_changelist")
    first = viewer_client.get(url)
    assert len(first.context["cl"].result_list) == 50
    assert "rows" not in first.context["cl"].keyset_older_url
    more = viewer_client.get(url, {"rows": 100})
    cl = more.context["cl"]
    assert len(cl.result_list) == 100 and "rows=100" in cl.keyset_older_url
    assert "rows=100" in cl.get_query_string({"status__exact": "created"})  # filters keep the size
    older = viewer_client.get(f"{url}{cl.keyset_older_url}")
    assert len(older.context["cl"].result_list) == 20
    assert b"rows per page:" in first.content
    for bad in ("7", "x", "100000"):
        answer = viewer_client.get(url, {"rows": bad})
        assert answer.status_code == 302 and answer["Location"].endswith("?e=1")
