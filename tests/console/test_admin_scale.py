"""The large lists at scale: bounded and estimated counts, keyset ("older") pages, capped page
numbers, and on PostgreSQL plans that seek an index instead of reading the whole table."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from billing.models import LedgerEntry
from jobs.models import Job
from runs.admin import RunAdmin
from runs.models import Run
from tests.console.conftest import build_run
from tests.conftest import ON_POSTGRES

RUNS = reverse("admin:runs_run_changelist")


def _bulk_runs(project, count: int, **fields) -> list[int]:
    template = build_run(project, "created", name="template")
    Run.objects.bulk_create([
        Run(organization_id=template.organization_id, project=project, name=f"bulk {index}", plan=template.plan,
            credit_limit=template.credit_limit, status_changed_at=template.status_changed_at, **fields)
        for index in range(count)], batch_size=500)
    return list(Run.objects.order_by("-id").values_list("pk", flat=True))


def _shown(response) -> list[int]:
    return [row.pk for row in response.context["cl"].result_list]


def test_the_run_list_reads_older_pages_by_keyset_to_the_end(viewer_client, project, monkeypatch):
    monkeypatch.setattr(RunAdmin, "list_per_page", 4)
    ids = _bulk_runs(project, 9)  # 10 runs with the template: pages of 4, 4, 2
    seen, url, pages = [], RUNS, 0
    while url:
        response = viewer_client.get(url)
        assert response.status_code == 200
        seen += _shown(response)
        older = response.context["cl"].keyset_older_url
        url = f"{RUNS}{older}" if older else None
        pages += 1
    assert seen == ids and pages == 3
    page = viewer_client.get(RUNS, {"cursor": ids[3]})
    assert _shown(page) == ids[4:8]
    assert b"keyset-older" in page.content and b"keyset-newest" in page.content
    assert "cursor" not in page.context["cl"].get_query_string({"status__exact": "created"})  # filters restart


def test_a_cursor_keeps_the_filters_and_bad_cursors_are_refused_without_an_error_page(viewer_client, project,
                                                                                      monkeypatch):
    monkeypatch.setattr(RunAdmin, "list_per_page", 2)
    ids = _bulk_runs(project, 5)
    failed = build_run(project, "failed", name="failed one").pk
    response = viewer_client.get(RUNS, {"status__exact": "created", "cursor": failed + 1})
    assert _shown(response) == ids[:2] and failed not in _shown(response)
    for bad in ("x", "-1", "0", "99999999999999999999", "1.5"):
        answer = viewer_client.get(RUNS, {"cursor": bad})
        assert answer.status_code == 302 and answer["Location"].endswith("?e=1")
    # Sorted by a column, a list has no cursor: asking for one is an invalid request, not a wrong page.
    assert viewer_client.get(RUNS, {"o": "2", "cursor": ids[0]}).status_code == 302


def test_page_numbers_stop_at_the_cap(viewer_client, project, monkeypatch, settings):
    monkeypatch.setattr(RunAdmin, "list_per_page", 2)
    settings.ORCHESTRATOR_ADMIN_MAX_PAGES = 3
    _bulk_runs(project, 9)
    last = viewer_client.get(RUNS, {"p": 3})
    assert last.status_code == 200 and last.context["cl"].paginator.num_pages == 3
    assert last.context["cl"].keyset_older_url  # the rest is read by keyset
    assert viewer_client.get(RUNS, {"p": 4}).status_code == 302  # a page past the cap: invalid, as past the end


def test_numbered_pages_show_their_slice_in_the_list_order(viewer_client, project, monkeypatch):
    monkeypatch.setattr(RunAdmin, "list_per_page", 3)
    ids = _bulk_runs(project, 7)  # 8 runs, newest first
    assert [_shown(viewer_client.get(RUNS, {"p": page})) for page in (1, 2, 3)] == [ids[:3], ids[3:6], ids[6:]]
    for order in ("1", "-1", "4"):  # sorted by a column: a page read by ids keeps the sort
        whole = _shown(viewer_client.get(RUNS, {"o": order, "rows": 200}))
        pages = [_shown(viewer_client.get(RUNS, {"p": page, "o": order})) for page in (1, 2, 3)]
        assert pages == [whole[:3], whole[3:6], whole[6:]] and len(whole) == 8
    assert _shown(viewer_client.get(RUNS, {"o": "1", "rows": 200})) != ids  # (a sort of its own: by name)


def test_a_filtered_list_counts_at_most_the_limit(viewer_client, project, settings):
    settings.ORCHESTRATOR_ADMIN_COUNT_LIMIT = 3
    _bulk_runs(project, 5)
    with CaptureQueriesContext(connection) as queries:
        response = viewer_client.get(RUNS, {"status__exact": "created"})
    assert b"3+ runs" in response.content
    counts = [q["sql"] for q in queries.captured_queries if "SELECT COUNT(*) FROM (SELECT" in q["sql"] and "runs_run" in q["sql"]]
    assert counts and all("LIMIT 4" in sql for sql in counts)
    settings.ORCHESTRATOR_ADMIN_COUNT_LIMIT = 100
    assert b"6 runs" in viewer_client.get(RUNS, {"status__exact": "created"}).content


def test_the_error_code_choices_come_from_the_latest_rows(viewer_client, project):
    _bulk_runs(project, 3, last_error_code="old_code")
    _bulk_runs(project, 2, last_error_code="new_code")
    with CaptureQueriesContext(connection) as queries:
        content = viewer_client.get(RUNS).content
    assert b"new_code (2)" in content and b"old_code (3)" in content
    top = [q["sql"] for q in queries.captured_queries if "GROUP BY" in q["sql"] and "last_error_code" in q["sql"]]
    assert top and all("LIMIT 5000" in sql for sql in top)  # never the whole table


def test_search_matches_each_word_in_name_error_code_project_and_id(viewer_client, project):
    one = build_run(project, "failed", name="nightly export").pk
    build_run(project, "created", name="weekly import")
    found = lambda term: set(_shown(viewer_client.get(RUNS, {"q": term})))  # noqa: E731
    assert found("nightly") == {one}
    assert found("NIGHTLY export") == {one}
    assert found(str(one)) >= {one}
    assert found("nightly weekly") == set()
    assert len(found(project.name)) == Run.objects.count()  # the project's name matches its runs
    assert found('"ly exp"') == {one}


@pytest.mark.skipif(ON_POSTGRES, reason="the estimate is PostgreSQL's; SQLite counts")
def test_the_unfiltered_list_counts_exactly_on_sqlite(viewer_client, project):
    _bulk_runs(project, 3)
    assert viewer_client.get(RUNS).context["cl"].paginator.count_kind == "exact"


# --- PostgreSQL: the plans -----------------------------------------------------------------------

SEEDED_RUNS = 60_000


def _clone(model, template_pk: int, count: int, overrides: dict[str, str]) -> None:
    """``count`` copies of one row made by the server (``generate_series`` as ``g``), with some
    columns given as SQL expressions."""
    columns = [field.column for field in model._meta.concrete_fields if not field.primary_key]
    table = model._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {table} ({', '.join(columns)}) SELECT "
                       f"{', '.join(overrides.get(column, f't.{column}') for column in columns)} "
                       f"FROM {table} AS t CROSS JOIN generate_series(1, {count}) AS g WHERE t.id = {template_pk}")


def _seed_postgres(project, job_in) -> None:
    """Enough rows that reading a whole table costs more than an index seek, then ANALYZE."""
    run = build_run(project, "running", name="template")
    _clone(Run, run.pk, SEEDED_RUNS, {
        "name": "'seeded ' || g",
        "status": "CASE WHEN g % 50 = 0 THEN 'running' WHEN g % 7 = 0 THEN 'failed' ELSE 'completed' END",
        "last_error_code": "CASE WHEN g % 7 = 0 THEN 'code_' || (g % 13) ELSE '' END",
        "status_changed_at": "now() - make_interval(secs => g)",
        "last_heartbeat": "CASE WHEN g % 50 = 0 THEN now() - interval '1 hour' END"})
    entry = LedgerEntry.objects.filter(run=run).order_by("pk").first()
    _clone(LedgerEntry, entry.pk, SEEDED_RUNS, {
        "kind": "CASE WHEN g % 3 = 0 THEN 'charge' ELSE 'reserve' END", "idempotency_key": "'seeded:' || g"})
    job = job_in("queued")
    _clone(Job, job.pk, SEEDED_RUNS, {
        "state": "CASE WHEN g % 20 = 0 THEN 'failed' ELSE 'completed' END", "lane": "''",
        "active_dedupe_key": "NULL", "dedupe_key": "'seeded:' || g"})
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE runs_run; ANALYZE billing_ledgerentry; ANALYZE jobs_job")


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_lists_their_filters_and_deep_pages_seek_indexes(viewer_client, project, job_in):
    _seed_postgres(project, job_in)
    middle = Run.objects.order_by("-id").values_list("pk", flat=True)[SEEDED_RUNS // 2]
    ledger_middle = LedgerEntry.objects.order_by("-id").values_list("pk", flat=True)[SEEDED_RUNS // 2]
    jobs = reverse("admin:jobs_job_changelist")
    ledger = reverse("admin:billing_ledgerentry_changelist")
    pages = [
        (RUNS, {}), (RUNS, {"status__exact": "failed"}), (RUNS, {"project__id__exact": project.pk}),
        (RUNS, {"stuck": "yes"}), (RUNS, {"escalated": "yes"}), (RUNS, {"last_error_code": "code_3"}),
        (RUNS, {"cursor": middle}), (RUNS, {"p": 50}), (RUNS, {"q": "seeded 4242"}), (RUNS, {"q": "code_5"}),
        (ledger, {}), (ledger, {"kind__exact": "charge"}), (ledger, {"cursor": ledger_middle}),
        (jobs, {}), (jobs, {"state__exact": "failed"}), (jobs, {"project__id__exact": project.pk}),
    ]
    for url, params in pages:
        with CaptureQueriesContext(connection) as queries:
            response = viewer_client.get(url, params)
        assert response.status_code == 200, (url, params)
        for query in queries.captured_queries:
            if not re.search(r'FROM "(runs_run|jobs_job|billing_ledgerentry)"', query["sql"]):
                continue
            with connection.cursor() as cursor:
                cursor.execute(f"EXPLAIN (ANALYZE, COSTS OFF) {query['sql']}")
                # A node "never executed" (the count behind a large estimate) reads nothing.
                plan = "\n".join(row[0] for row in cursor.fetchall() if "never executed" not in row[0])
            # A bounded count may read the table under its LIMIT (it stops after the limit's rows
            # match: the planner's pick for a common value); every other read seeks an index.
            bounded = "COUNT(*) FROM (SELECT" in query["sql"] and re.search(
                r"Limit \(.*\n\s+->  Seq Scan on", plan)
            assert bounded or not re.search(r"Seq Scan on (runs_run|jobs_job|billing_ledgerentry)\b", plan), \
                f"{url} {params}\n{query['sql']}\n{plan}"
    assert "about" in viewer_client.get(RUNS).context["cl"].paginator.count_label

    # The stuck list is counted by the parts of the rule, each along its index, under one bound:
    # not the rule as one OR (a bitmap of every live run, then the table's rows).
    with CaptureQueriesContext(connection) as queries:
        assert viewer_client.get(RUNS, {"stuck": "yes"}).status_code == 200
    counts = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("SELECT COUNT(*)")]
    assert len(counts) == 1 and "UNION ALL" in counts[0]
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, COSTS OFF) {counts[0]}")
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "BitmapOr" not in plan and "Seq Scan" not in plan, plan

    # The dashboard's reads of runs (bounded counts by status and of each stuck part, the stuck
    # list) seek indexes too: none reads the runs table, not even under a limit.
    with CaptureQueriesContext(connection) as queries:
        response = viewer_client.get(reverse("dashboard:data"))
    assert response.status_code == 200
    assert response.json()["metrics"]["runs-stuck"] > 0  # the seeded running runs are silent
    explained = 0
    for query in queries.captured_queries:
        if 'FROM "runs_run"' not in query["sql"]:
            continue
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (ANALYZE, COSTS OFF) {query['sql']}")
            plan = "\n".join(row[0] for row in cursor.fetchall())
        assert not re.search(r"Seq Scan on runs_run\b", plan), f"dashboard\n{query['sql']}\n{plan}"
        explained += 1
    assert explained >= 3  # the counts, the stuck list, the failures by error code
