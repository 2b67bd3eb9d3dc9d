"""The large collections (runs, jobs, ledger) page by id cursor without counting the whole table
(``count`` exact up to a small bound, API 1.1); ``?page=`` keeps the page-number answer."""

from __future__ import annotations

import re

import pytest
from django.conf import settings
from django.db import connection
from django.test.utils import CaptureQueriesContext

from billing.models import LedgerEntry
from jobs.models import Job
from runs.models import Run

from tests.api.conftest import assert_error
from tests.api.test_runs import create_run


def _walk(client, url: str) -> tuple[list[int], list[dict]]:
    ids, pages = [], []
    while url:
        page = client.get(url).json()
        pages.append(page)
        ids += [row.get("id", row.get("jobId")) for row in page["results"]]
        url = page["next"]
    return ids, pages


def test_runs_page_by_cursor_newest_first_to_the_end_and_back(tenant):
    made = [create_run(tenant)["id"] for _ in range(5)]
    ids, pages = _walk(tenant.client, "/api/v1/runs/?page_size=2")
    assert ids == made[::-1] and len(pages) == 3
    assert all(page["count"] == 5 for page in pages) and "cursor=" in pages[0]["next"]
    back = tenant.client.get(pages[2]["previous"]).json()
    assert [row["id"] for row in back["results"]] == ids[2:4]


def test_no_query_counts_the_whole_table_or_offsets(tenant):
    for _ in range(3):
        create_run(tenant)
    first = tenant.client.get("/api/v1/runs/?page_size=1").json()
    with CaptureQueriesContext(connection) as queries:
        assert tenant.client.get(first["next"]).status_code == 200
    sql = [q["sql"] for q in queries.captured_queries if "runs_run" in q["sql"]]
    assert not any("OFFSET" in s for s in sql)
    assert all("LIMIT" in s for s in sql if "COUNT(" in s.upper())


def test_count_is_null_beyond_the_limit(tenant, settings):
    settings.ORCHESTRATOR_API_COUNT_LIMIT = 2
    for _ in range(3):
        create_run(tenant)
    page = tenant.client.get("/api/v1/runs/?page_size=2").json()
    assert page["count"] is None and len(page["results"]) == 2
    assert tenant.client.get(page["next"]).json()["count"] is None
    settings.ORCHESTRATOR_API_COUNT_LIMIT = 3
    assert tenant.client.get("/api/v1/runs/?page_size=2").json()["count"] == 3


def test_a_first_page_holding_every_row_is_its_own_count(tenant, settings):
    settings.ORCHESTRATOR_API_COUNT_LIMIT = 2  # below the rows: the count comes from the page itself
    for _ in range(3):
        create_run(tenant)
    with CaptureQueriesContext(connection) as queries:
        page = tenant.client.get("/api/v1/runs/").json()
    assert page["count"] == 3 and len(page["results"]) == 3 and page["next"] is None
    assert not any("COUNT(" in q["sql"].upper() for q in queries.captured_queries if "runs_run" in q["sql"])
    with CaptureQueriesContext(connection) as queries:
        assert tenant.client.get("/api/v1/runs/?page_size=2").json()["count"] is None
    assert sum("COUNT(" in q["sql"].upper() for q in queries.captured_queries if "runs_run" in q["sql"]) == 1


def test_the_schema_names_the_version_and_the_bound(tenant):
    schema = tenant.client.get("/api/schema/?format=json").json()
    assert schema["info"]["version"] == "1.1.0" and "1,000" in schema["info"]["description"]
    described = schema["components"]["schemas"]["PaginatedRunList"]["properties"]["count"]["description"]
    assert "1,000" in described and "API 1.1" in described


def test_page_numbers_answer_as_before(tenant):
    for _ in range(3):
        create_run(tenant)
    page = tenant.client.get("/api/v1/runs/?page=1&page_size=2").json()
    assert page["count"] == 3 and "page=2" in page["next"] and page["previous"] is None
    assert_error(tenant.client.get("/api/v1/runs/?page=9"), 404, "not_found")


def test_ledger_and_jobs_page_by_cursor_and_bad_cursors_are_404(tenant):
    for _ in range(3):
        run = create_run(tenant)
        assert tenant.client.post(f"/api/v1/runs/{run['id']}/start/").status_code == 200  # a reservation each
    ids, pages = _walk(tenant.client, "/api/v1/ledger/?page_size=1")
    assert ids == sorted(ids, reverse=True) and len(ids) >= 3 and len(pages) == len(ids)
    for bad in ("x", "%FF%FE"):  # not a cursor (a decodable string without a position reads the first page)
        assert_error(tenant.client.get(f"/api/v1/ledger/?cursor={bad}"), 404, "not_found")
        assert_error(tenant.client.get(f"/api/v1/jobs/?cursor={bad}"), 404, "not_found")
    assert tenant.client.get("/api/v1/jobs/?page_size=1").json()["results"] is not None


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_collections_pages_and_counts_seek_indexes_on_postgres(tenant):
    """With enough rows that reading a table costs more than a seek: every read of a page, its
    bounded count and a page four cursors deep walks an index (EXPLAIN ANALYZE), and a count reads
    at most the bound's rows."""
    for _ in range(2):
        run = create_run(tenant)
        assert tenant.client.post(f"/api/v1/runs/{run['id']}/start/").status_code == 200
    template = Run.objects.filter(organization=tenant.organization).order_by("pk").first()
    entry = LedgerEntry.objects.filter(organization=tenant.organization).order_by("pk").first()
    _clone(Run, template.pk, 30_000, {"name": "'seeded ' || g"})
    _clone(LedgerEntry, entry.pk, 30_000, {"idempotency_key": "'seeded:' || g"})
    job = Job.objects.filter(organization=tenant.organization).order_by("pk").first()
    _clone(Job, job.pk, 30_000, {"state": "'completed'", "lane": "''", "active_dedupe_key": "NULL",
                                 "dedupe_key": "'seeded:' || g"})
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE runs_run; ANALYZE billing_ledgerentry; ANALYZE jobs_job")
    for url in ("/api/v1/runs/", "/api/v1/ledger/", "/api/v1/jobs/", "/api/v1/runs/?status=created"):
        page, deep = tenant.client.get(url).json(), url
        for _ in range(4):
            deep = page["next"] or deep
            page = tenant.client.get(deep).json()
        with CaptureQueriesContext(connection) as queries:
            assert tenant.client.get(deep).status_code == 200
        for query in queries.captured_queries:
            if not re.search(r'FROM "(runs_run|jobs_job|billing_ledgerentry)"', query["sql"]):
                continue
            assert "OFFSET" not in query["sql"]
            with connection.cursor() as cursor:
                cursor.execute(f"EXPLAIN (ANALYZE, COSTS OFF) {query['sql']}")
                plan = "\n".join(row[0] for row in cursor.fetchall())
            if "COUNT(" in query["sql"].upper():
                # A bounded count stops after the bound's rows, whichever way it reads them (every
                # row here matches: the planner may well read the table itself under the limit).
                read = max(int(n) for n in re.findall(r"rows=(\d+) loops", plan))
                removed = sum(int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", plan))
                assert read + removed <= settings.ORCHESTRATOR_API_COUNT_LIMIT + 1, (url, plan)
            else:
                assert not re.search(r"Seq Scan on (runs_run|jobs_job|billing_ledgerentry)\b", plan), (url, plan)


def _clone(model, template_pk: int, count: int, overrides: dict[str, str]) -> None:
    """``count`` copies of one row made by the server (``generate_series`` as ``g``)."""
    columns = [field.column for field in model._meta.concrete_fields if not field.primary_key]
    table = model._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {table} ({', '.join(columns)}) SELECT "
                       f"{', '.join(overrides.get(column, f't.{column}') for column in columns)} "
                       f"FROM {table} AS t CROSS JOIN generate_series(1, {count}) AS g WHERE t.id = {template_pk}")
