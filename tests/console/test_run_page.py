"""The run page: what an operator needs first at the top, the Gantt chart's container and data,
the task graph of a dag agent, long sections collapsed, and a query count that does not grow."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from runs import services
from runs.models import Run, StepAttempt
from tests.conftest import make_plan, run_ticked
from tests.console.conftest import CREDIT_LIMIT, build_run

pytestmark = pytest.mark.django_db

DAG_PLAN = {"agents": [{"name": "research", "parallelism_mode": "dag", "tasks": [
    {"name": "fetch", "steps": [{"name": "hello", "tool": "echo", "args": {"text": "hi"}}]},
    {"name": "parse", "depends_on": ["fetch"], "steps": [{"name": "p", "tool": "echo", "args": {"text": "p"}}]},
    {"name": "index", "depends_on": ["fetch"], "steps": [{"name": "i", "tool": "echo", "args": {"text": "i"}}]},
    {"name": "report", "depends_on": ["parse", "index"], "steps": [{"name": "r", "tool": "echo",
                                                                      "args": {"text": "r"}}]},
]}]}


def page(client, run: Run):
    with CaptureQueriesContext(connection) as queries:
        response = client.get(reverse("admin:runs_run_change", args=[run.pk]))
    assert response.status_code == 200
    return response.content.decode(), len(queries)


def summary_of(html: str) -> str:
    start = html.index('id="run-summary"')
    return html[start:html.index("</section>", start)]


def test_the_top_shows_status_reason_error_age_credits_and_the_runbooks_that_apply(login, make_staff, project):
    run = build_run(project, "failed", name="top")
    client = login(make_staff("rb", "runs.retry_run", "runs.void_run", "runs.force_fail_run"))
    html, _ = page(client, run)
    top = summary_of(html)
    assert html.index('id="run-summary"') < html.index('id="run-gantt"')  # the summary comes first
    assert f'data-live="run-status" data-run="{run.pk}" data-value="failed"' in top
    assert "<code>worker_lost</code> the worker went away" in top
    assert re.search(r"created \d+ s ago; in failed since \d+ s ago", top), top
    assert re.sub(r"<[^>]+>", "", top).count(f"1 charged of {CREDIT_LIMIT} reserved · {CREDIT_LIMIT - 1} refunded · "
                                             f"0 held") == 1
    assert f"limit {CREDIT_LIMIT} per attempt" in top
    assert "attempt</dt><dd>1 of 3" in top
    runbooks = set(re.findall(r'data-runbook="([a-z_]+)"', top))
    assert "retry" in runbooks and "void" in runbooks and "force_fail" not in runbooks  # only what applies

    completed = build_run(project, "completed", name="done")
    top = summary_of(page(client, completed)[0])
    assert "last error</dt><dd class=\"run-summary-error\">none" in top and "took " in top
    assert "retry" not in re.findall(r'data-runbook="([a-z_]+)"', top)


def test_long_sections_are_collapsed_and_the_gantt_container_points_at_the_timeline(viewer_client, project):
    run = build_run(project, "running", name="sections")
    html, _ = page(viewer_client, run)
    url = reverse("admin:runs_run_timeline", args=[run.pk])
    assert f'id="run-gantt" data-run="{run.pk}" data-timeline-url="{url}"' in html
    assert "runs/timeline.js" in html and "runs/run_page.css" in html
    for title in ("Agents → tasks → steps", "Ledger", "Latest events and audit trail", "Plan",
                  "Queued jobs: why is this waiting?"):
        # Django draws a collapsed fieldset as <details> with its title as the <summary>
        assert re.search(r"<details[^>]*>\s*<summary>\s*<h2[^>]*>\s*" + re.escape(title), html), title
    assert not re.search(r"<details[^>]*>\s*<summary>\s*<h2[^>]*>\s*Timeline", html)  # the chart stays open


def test_the_task_graph_of_a_dag_agent(viewer_client, project):
    run = services.run_create(project=project, name="dag", plan=DAG_PLAN)
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    html, _ = page(viewer_client, run)
    graph = html[html.index('<svg class="task-graph"'):]
    graph = graph[:graph.index("</svg>")]
    assert graph.count('class="dag-node') == 4
    edges = set(re.findall(r'class="dag-edge" data-from="(\w+)" data-to="(\w+)"', graph))
    assert edges == {("fetch", "parse"), ("fetch", "index"), ("parse", "report"), ("index", "report")}

    plain = build_run(project, "running", name="plain")
    assert "no dag agent in the current attempt" in page(viewer_client, plain)[0]


def test_the_run_page_queries_do_not_grow_with_the_run(viewer_client, project):
    small = build_run(project, "running", name="small")
    big = services.run_create(project=project, name="big dag", plan={
        "agents": [{**DAG_PLAN["agents"][0], "name": f"dag{index}"} for index in range(3)]
        + make_plan(agents=3, tasks=3, steps=4)["agents"]})
    services.run_start(run_id=big.pk)
    run_ticked(big.pk)  # no job of either run waits: the two pages differ by their trees only
    for step in big.steps.order_by("pk")[:20]:
        services.step_attempt_succeed(attempt_id=services.step_begin(step_id=step.pk).pk, output={})
    page(viewer_client, small)  # warm the per-process caches
    small_html, small_queries = page(viewer_client, small)
    big_html, big_queries = page(viewer_client, big)
    assert big_html.count('<svg class="task-graph"') == 3 and 'id="run-gantt"' in small_html
    assert big_queries == small_queries

    # and the chart's data: one query for the tries however many there are
    def timeline_queries(run):
        with CaptureQueriesContext(connection) as queries:
            body = viewer_client.get(reverse("admin:runs_run_timeline", args=[run.pk])).json()
        return len(queries), body["count"]

    assert timeline_queries(small)[1] == 2 and timeline_queries(big)[1] == 20
    assert timeline_queries(big)[0] == timeline_queries(small)[0]


def test_the_pages_timeline_is_the_apis_for_anyone_who_may_view_the_run(viewer_client, login, make_staff, project):
    run = build_run(project, "completed", name="tries")
    url = reverse("admin:runs_run_timeline", args=[run.pk])
    body = viewer_client.get(url, {"unknown": "x"}).json()
    assert body["count"] == 3 and body["next"] is None and body["status"] == "completed"
    assert body["credits"] == {"limit": CREDIT_LIMIT, "reserved": CREDIT_LIMIT, "charged": 3,
                               "refunded": CREDIT_LIMIT - 3}
    assert [item["step"]["name"] for item in body["items"]] == ["s0", "s1", "s2"]
    assert {item["id"] for item in body["items"]} == set(StepAttempt.objects.filter(run=run).values_list("pk",
                                                                                                         flat=True))
    first = viewer_client.get(url, {"limit": 2}).json()
    assert len(first["items"]) == 2 and first["next"].startswith("http")
    assert viewer_client.get(first["next"]).json()["items"] == body["items"][2:]
    assert viewer_client.get(url, {"limit": 0}).status_code == 400
    assert viewer_client.get(reverse("admin:runs_run_timeline", args=[2**40])).status_code == 404
    nobody = login(make_staff("nobody", view=False))
    assert nobody.get(url).status_code == 403
