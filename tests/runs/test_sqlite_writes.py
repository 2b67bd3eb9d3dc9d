"""On SQLite, the writes PostgreSQL makes in one ``WITH`` go through one statement too: an insert into
a temporary view whose trigger makes them (``core.sql.sqlite_writes``); a run's tree is inserted
with keys read first (``core.inserts.insert_tree``)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django_fsm import ConcurrentTransition

from billing.models import CreditAccount
from billing.services import ledger_reserve
from core.fsm import moves_put_off, save_moved_together
from core.inserts import insert_tree
from core.models import Event
from core.sql import WriteMissed, sqlite_writes
from runs import outbox, services
from runs.models import Agent, Step, Task
from tests.conftest import make_plan

pytestmark = [pytest.mark.django_db,
              pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's statement for several writes")]


def running(project, name, *, steps=2):
    run = services.run_create(project=project, name=name, plan=make_plan(steps=steps))
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    return run


def writes(captured) -> list[str]:
    return [query["sql"] for query in captured.captured_queries if not query["sql"].startswith("CREATE TEMP ")]


def test_the_writes_are_made_in_order_by_one_statement_and_a_missed_guard_undoes_them_all(project):
    run = running(project, "guarded")
    first, second = Step.objects.filter(run=run).order_by("sequence")
    update = 'UPDATE "runs_step" SET "name" = %s WHERE "id" = %s AND "status" = %s'
    insert = 'INSERT INTO "core_event" (type, organization_id, payload, created_at) VALUES (%s, %s, %s, %s)'
    with transaction.atomic():
        with CaptureQueriesContext(connection) as captured:
            sqlite_writes([(update, ["renamed", first.pk, "pending"], True),
                           (insert, ["written", None, "{}", "2026-01-01 00:00:00"], False)])
        assert len(writes(captured)) == 1 and '/* UPDATE "runs_step", INSERT INTO "core_event" */' in writes(captured)[0]
        with pytest.raises(WriteMissed) as missed:
            sqlite_writes([(update, ["again", first.pk, "pending"], True),
                           (update, ["never", second.pk, "running"], True)])  # not running: the guard refuses
        assert missed.value.index == 1
        assert Step.objects.get(pk=first.pk).name == "renamed"  # the refused statement is undone as a whole
        assert Event.objects.filter(type="written").count() == 1  # and the transaction goes on
    assert Step.objects.get(pk=second.pk).name != "never"


def test_a_rollback_that_took_the_view_away_makes_it_again(project):
    run = running(project, "rolled back")
    step = Step.objects.filter(run=run).order_by("sequence").first()
    update = 'UPDATE "runs_step" SET "last_error" = %s WHERE "id" = %s'
    with pytest.raises(RuntimeError), transaction.atomic():
        sqlite_writes([(update, ["first", step.pk], True), (update, ["first", step.pk], True)])
        raise RuntimeError("rolled back with the view it made")
    sqlite_writes([(update, ["second", step.pk], True), (update, ["second", step.pk], True)])
    assert Step.objects.get(pk=step.pk).last_error == "second"


def test_moved_rows_keep_their_values_through_the_statement(project):
    run = running(project, "values")
    step = Step.objects.filter(run=run).order_by("sequence").first()
    task = Task.objects.get(pk=step.task_id)
    step.output = {"text": "it's \"quoted\"", "items": [1, 2.5, None, True]}
    step.finished_at = datetime(2026, 5, 4, 3, 2, 1, 123456, tzinfo=timezone.utc)
    step.not_before = None
    step.last_error = "ünïcode ✓"
    task.last_error = "{\"looks\": \"like json\"}"
    with transaction.atomic():
        save_moved_together([(step, ("output", "finished_at", "not_before", "last_error")),
                             (task, ("last_error",))])
    step.refresh_from_db()
    task.refresh_from_db()
    assert step.output == {"text": "it's \"quoted\"", "items": [1, 2.5, None, True]}
    assert step.finished_at == datetime(2026, 5, 4, 3, 2, 1, 123456, tzinfo=timezone.utc)
    assert step.not_before is None and step.last_error == "ünïcode ✓"
    assert task.last_error == "{\"looks\": \"like json\"}"


def test_a_stale_row_among_kept_moves_refuses_and_writes_none_of_them(project):
    run = running(project, "stale")
    agent, stale = Agent.objects.get(run=run), Task.objects.get(run=run)
    Task.objects.filter(pk=stale.pk).update(status="running")  # moved behind the copy's back
    task = Task.objects.get(pk=stale.pk)
    with pytest.raises(ConcurrentTransition, match=f"Task {stale.pk}"), transaction.atomic(), moves_put_off():
        agent.begin()
        agent.save_moved(agent.MOVING_FIELDS)
        stale.begin()
        stale.save_moved(stale.MOVING_FIELDS)
    assert Agent.objects.get(pk=agent.pk).status == "pending"
    assert Task.objects.get(pk=task.pk).status == "running"


def test_a_tree_inserted_in_a_transaction_takes_keys_past_every_one_given(project):
    run = running(project, "tree", steps=1)
    gone = Agent.objects.create(run=run, name="gone", sequence=9, attempt_number=9)
    Agent.objects.filter(pk=gone.pk).delete()  # its key is never given again, as AUTOINCREMENT does
    agents = [Agent(run=run, name=f"a{n}", sequence=10 + n, attempt_number=9) for n in range(2)]
    tasks = [Task(run=run, agent=agents[n % 2], name=f"t{n}", sequence=n) for n in range(3)]
    with transaction.atomic(), CaptureQueriesContext(connection) as captured:
        insert_tree([(agents, None), (tasks, "agent")])
    assert len(writes(captured)) == 2  # the keys, then the rows of both levels
    assert [agent.pk for agent in agents] == [gone.pk + 1, gone.pk + 2]
    for task in tasks:
        stored = Task.objects.get(pk=task.pk)
        assert (stored.name, stored.agent_id) == (task.name, task.agent_id) and task.agent_id == task.agent.pk
    assert Agent.objects.create(run=run, name="next", sequence=20, attempt_number=9).pk == gone.pk + 3


def test_the_account_kept_for_the_batch_is_written_before_the_next_entry_reads_it(project):
    run = running(project, "account")
    account = CreditAccount.objects.get(organization_id=project.organization_id)
    with outbox.run_atomic():
        for n in range(2):
            ledger_reserve(organization_id=project.organization_id, project_id=project.pk, run_id=run.pk,
                           attempt_number=1, amount=5, idempotency_key=f"extra:{n}", emit=outbox.run_event_record)
        assert CreditAccount.objects.get(pk=account.pk).reserved == account.reserved + 10
    assert CreditAccount.objects.get(pk=account.pk).reserved == account.reserved + 10
