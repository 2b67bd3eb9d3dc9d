"""The planner's statistics of the run engine's tables are taken again by the workers' maintenance
once enough of their rows changed, so the statements prepared on them are planned afresh."""

from __future__ import annotations

import time

import pytest
from django.db import connection

from core import planner
from runs import services
from tests.conftest import make_plan

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

RUN_TABLES = {"runs_run", "runs_runattempt", "runs_agent", "runs_task", "runs_step", "runs_stepattempt"}


def reltuples(table: str) -> float:
    with connection.cursor() as cursor:
        cursor.execute("SELECT reltuples FROM pg_class WHERE oid = %s::regclass", [table])
        return cursor.fetchone()[0]


def refreshed_until(tables: set[str]) -> set[str]:
    """What ``statistics_refresh`` analyzed until every one of ``tables`` was (the server takes the
    counts of a transaction in within a second or so)."""
    seen: set[str] = set()
    deadline = time.monotonic() + 15
    while not tables <= seen:
        assert time.monotonic() < deadline, f"never refreshed: {sorted(tables - seen)}"
        seen.update(planner.statistics_refresh())
        time.sleep(0.2)
    return seen


def test_the_run_tables_statistics_are_taken_again_once_they_grew(project, monkeypatch):
    monkeypatch.setattr(planner, "STATISTICS_MIN_GROWTH", 20)
    monkeypatch.setattr(planner, "STATISTICS_MIN_CHANGES", 10**9)  # the growth alone
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    assert not RUN_TABLES & set(planner.statistics_refresh())  # nothing changed since
    for number in range(21):
        run = services.run_create(project=project, name=f"stats {number}", plan=make_plan(steps=2))
        services.run_start(run_id=run.pk)
        services.run_mark_running(run_id=run.pk)  # its agent, task and steps written
    refreshed_until({"runs_run", "runs_step"})
    assert reltuples("runs_step") >= 42  # the planner knows the steps are there
    assert reltuples("runs_run") >= 21
    assert not RUN_TABLES & set(planner.statistics_refresh())  # nothing changed since they were taken


def test_a_table_is_analyzed_again_once_it_doubled_not_before(project, monkeypatch):
    monkeypatch.setattr(planner, "STATISTICS_MIN_GROWTH", 5)
    runs = [services.run_create(project=project, name=f"stats {number}", plan=make_plan(steps=1))
            for number in range(10)]
    refreshed_until({"runs_run"})
    for number in range(6):  # 16 runs: not twice the 10 the statistics know
        services.run_create(project=project, name=f"more {number}", plan=make_plan(steps=1))
    for run in runs:  # nor do its rows' changes count: the run tables are not a queue
        services.run_start(run_id=run.pk)
    time.sleep(1.0)
    assert "runs_run" not in planner.statistics_refresh()
    for number in range(4):  # 20 runs
        services.run_create(project=project, name=f"last {number}", plan=make_plan(steps=1))
    refreshed_until({"runs_run"})
    assert reltuples("runs_run") >= 20


def test_a_server_that_refuses_leaves_the_statistics_and_says_so_once(project, monkeypatch, caplog):
    from django.db import DatabaseError

    def refused(*args, **kwargs):
        raise DatabaseError("must be owner of table runs_run")

    monkeypatch.setattr(planner, "_refused", [])
    monkeypatch.setattr(connection, "cursor", refused)
    with caplog.at_level("WARNING", logger="orchestrator.planner"):
        assert planner.statistics_refresh() == []
        assert planner.statistics_refresh() == []
    assert [record.getMessage() for record in caplog.records] == ["could not refresh the planner's statistics"]


def test_a_table_locked_by_a_migration_is_left_for_the_next_check(project, monkeypatch):
    import psycopg

    monkeypatch.setattr(planner, "STATISTICS_MIN_GROWTH", 5)
    monkeypatch.setattr(planner, "STATISTICS_LOCK_TIMEOUT_MS", 200)
    monkeypatch.setattr(planner, "_refused", [])
    for number in range(6):
        services.run_create(project=project, name=f"stats {number}", plan=make_plan(steps=1))
    settings = connection.settings_dict
    with psycopg.connect(host=settings["HOST"] or None, port=settings["PORT"] or None, user=settings["USER"],
                         password=settings["PASSWORD"] or None, dbname=settings["NAME"]) as other:
        other.execute("LOCK TABLE runs_run IN ACCESS EXCLUSIVE MODE")  # held until this block ends
        started = time.monotonic()
        assert planner.statistics_refresh() == []
        assert time.monotonic() - started < 5  # gave up after its lock timeout
    refreshed_until({"runs_run"})  # the next check takes them
