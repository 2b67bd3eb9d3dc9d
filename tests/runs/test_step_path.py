"""The step path's transactions: a step's begin records its tool call with it, a settlement commits
with the command's result or not at all, and a transaction's events are written together, in order."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import OperationalError, connection, transaction

from billing.models import LedgerEntry
from core.models import Event
from core.services import event_record
from jobs.models import CommandRecord
from runs import outbox, services
from runs.invariants import invariants_check
from runs.models import Run, StepAttempt
from tests.conftest import make_plan
from tests.drive import drain_jobs

pytestmark = pytest.mark.django_db(transaction=True)

RUN_EVENT_PREFIXES = ("run_", "agent_", "task_", "step_", "ledger_", "command_")


@pytest.fixture(autouse=True)
def no_wake_messages(monkeypatch):
    monkeypatch.setattr("jobs.wake._send", lambda count: None)


def running(project, name, *, steps):
    """A run of one agent and task with ``steps`` steps, started and marked running (nodes spawned)."""
    run = services.run_create(project=project, name=name, plan=make_plan(steps=steps))
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    return run


def finish(project, plan):
    run = services.run_create(project=project, name="path", plan=plan)
    services.run_start(run_id=run.pk)
    drain_jobs(until=lambda: Run.objects.get(pk=run.pk).status in (Run.Status.COMPLETED, Run.Status.FAILED),
               timeout=30)
    run.refresh_from_db()
    return run


def test_a_chained_run_writes_every_event_once_in_the_order_of_its_changes(project):
    run = finish(project, make_plan(steps=2))
    assert run.status == Run.Status.COMPLETED
    events = list(Event.objects.filter(project_id=project.pk).order_by("id").values_list("type", "payload"))
    kinds = [kind for kind, _ in events if kind.startswith(RUN_EVENT_PREFIXES)]
    assert kinds == [
        "run_created", "ledger_reserve", "run_pending", "run_running",
        "agent_running", "task_running", "step_running", "command_recorded",
        "command_succeeded", "ledger_charge", "step_completed", "step_running", "command_recorded",
        "command_succeeded", "ledger_charge", "step_completed", "task_completed", "agent_completed",
        "ledger_refund", "run_completed",
    ]
    keys = sorted(StepAttempt.objects.filter(run=run).values_list("idempotency_key", flat=True))
    recorded = [payload["idempotencyKey"] for kind, payload in events if kind == "command_recorded"]
    assert sorted(recorded) == keys  # each attempt's tool call recorded once, under its key
    charges = LedgerEntry.objects.filter(run_id=run.pk, kind=LedgerEntry.Kind.CHARGE)
    assert sorted(charges.values_list("idempotency_key", flat=True)) == keys
    assert invariants_check() == []


def test_a_settlement_that_fails_leaves_the_command_unfinished_and_the_replay_completes_it(project, monkeypatch):
    """The settlement commits with the command's success or neither does: the job's retry resumes the
    same attempt by its key (no new attempt), and each step is charged once."""
    from runs.services import steps

    real, failures = steps._succeeded, []

    def fail_once(run, attempt, step, output):
        if not failures:
            failures.append(attempt.idempotency_key)
            raise OperationalError("the database went away mid-settlement")  # transient: the job retries
        return real(run, attempt, step, output)

    monkeypatch.setattr(steps, "_succeeded", fail_once)
    run = services.run_create(project=project, name="path", plan=make_plan(steps=2))
    services.run_start(run_id=run.pk)

    def interrupted():
        return bool(failures)

    drain_jobs(until=interrupted, timeout=30)
    record = CommandRecord.objects.get(idempotency_key=failures[0])
    assert record.status == "recorded"  # the success rolled back with the settlement
    assert StepAttempt.objects.get(idempotency_key=failures[0]).outcome == StepAttempt.Outcome.RUNNING
    assert not LedgerEntry.objects.filter(run_id=run.pk, kind=LedgerEntry.Kind.CHARGE).exists()
    drain_jobs(until=lambda: Run.objects.get(pk=run.pk).status == Run.Status.COMPLETED, timeout=30)
    record.refresh_from_db()
    assert (record.status, record.attempts) == ("succeeded", 2)
    assert StepAttempt.objects.filter(run=run).count() == 2  # resumed by its key, not retried
    keys = sorted(StepAttempt.objects.filter(run=run).values_list("idempotency_key", flat=True))
    charges = LedgerEntry.objects.filter(run_id=run.pk, kind=LedgerEntry.Kind.CHARGE)
    assert sorted(charges.values_list("idempotency_key", flat=True)) == keys
    assert invariants_check() == []


def test_a_batch_writes_its_rows_in_order_in_one_statement(django_assert_num_queries):
    with outbox.run_atomic():
        for n in range(3):
            outbox.run_event_record(type=f"batched_{n}", organization_id=None, payload={"n": n})
        assert not Event.objects.filter(type__startswith="batched_").exists()  # kept until the block ends
        with django_assert_num_queries(1):
            outbox.run_events_flush()
        outbox.run_event_record(type="batched_3", organization_id=None)
    assert list(Event.objects.filter(type__startswith="batched_").order_by("id").values_list("type", flat=True)) == [
        "batched_0", "batched_1", "batched_2", "batched_3"]


def test_a_nested_batch_that_fails_drops_its_rows_and_keeps_the_outer_ones():
    with outbox.run_atomic():
        outbox.run_event_record(type="outer_before", organization_id=None)
        with pytest.raises(RuntimeError), outbox.run_atomic():
            outbox.run_event_record(type="inner", organization_id=None)
            outbox.run_events_flush()
            outbox.run_event_record(type="inner_after_flush", organization_id=None)
            raise RuntimeError("rolled back")
        event_record(type="outer_foreign", organization_id=None)
        outbox.run_event_record(type="outer_after", organization_id=None)
    assert not Event.objects.filter(type__startswith="inner").exists()
    assert list(Event.objects.filter(type__startswith="outer").order_by("id").values_list("type", flat=True)) == [
        "outer_before", "outer_foreign", "outer_after"]


def test_outside_a_batch_an_event_is_written_at_once():
    with transaction.atomic():
        outbox.run_event_record(type="alone", organization_id=None)
        assert Event.objects.filter(type="alone").count() == 1


def test_a_node_write_refuses_a_copy_whose_state_moved_since_it_was_read(project):
    from django_fsm import ConcurrentTransition

    from runs.models import Agent, Step

    run = running(project, "copies", steps=1)
    first, second = Step.objects.get(run=run), Step.objects.get(run=run)
    first.begin()
    first.save_moved(first.MOVING_FIELDS)
    second.begin()  # pending → running again on a stale copy: the row is running already
    with pytest.raises(ConcurrentTransition), transaction.atomic():
        second.save_moved(second.MOVING_FIELDS)
    assert Step.objects.get(pk=first.pk).status == "running"
    first.complete()
    first.save_moved(first.MOVING_FIELDS)  # the copy that moved it goes on from what it wrote
    assert Step.objects.get(pk=first.pk).status == "completed"


def test_nodes_saved_together_refuse_a_copy_whose_state_moved_since_it_was_read(project):
    from django_fsm import ConcurrentTransition

    from core.fsm import save_moved_together
    from runs.models import Agent, Step, Task

    run = running(project, "together", steps=1)
    agent, task, step = Agent.objects.get(run=run), Task.objects.get(run=run), Step.objects.get(run=run)
    stale = Step.objects.get(run=run)
    for node in (agent, task, step):
        node.begin()
    save_moved_together([(node, node.MOVING_FIELDS) for node in (agent, task, step)])
    assert [type(node).objects.get(pk=node.pk).status for node in (agent, task, step)] == ["running"] * 3
    agent.complete()
    stale.begin()  # pending → running again on a stale copy: the row is running already
    with pytest.raises(ConcurrentTransition), transaction.atomic():
        save_moved_together([(agent, agent.MOVING_FIELDS), (stale, stale.MOVING_FIELDS)])
    assert Agent.objects.get(pk=agent.pk).status == "running"  # rolled back with the refused move
    step.complete()
    save_moved_together([(step, step.MOVING_FIELDS)])  # the copies that moved them go on from what they wrote
    assert Step.objects.get(pk=step.pk).status == "completed"


def test_a_step_charge_locks_the_account_last_and_its_event_keeps_its_place(project):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    for name in ("warm", "charge"):  # the first settles one the same way (SQLite makes its statement's view)
        run = running(project, name, steps=2)
        first = services.runnable_steps(Run.objects.get(pk=run.pk))[0]
        attempt = services.step_begin(step_id=first.pk)
        if name == "warm":
            services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True})
    last_event = Event.objects.order_by("-id").values_list("id", flat=True).first()
    with CaptureQueriesContext(connection) as captured:
        assert services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True}).decision == "completed"
    statements = [query["sql"] for query in captured.captured_queries]
    account_lock = next(i for i, sql in enumerate(statements) if 'FROM "billing_creditaccount"' in sql)
    assert any('UPDATE "runs_step"' in sql for sql in statements)  # alone, in a WITH, or named by a batch
    # The organization's account is locked at the end of the settlement: after its lock come only
    # the ledger's write and the transaction's last write (the events, with the moves kept for it).
    after = [sql for sql in statements[account_lock + 1:] if sql.strip().upper() != "COMMIT"]
    assert not any(sql.lstrip().upper().startswith("SELECT") for sql in after)
    assert all(any(table in sql for table in ("billing_ledgerentry", "billing_creditaccount", "core_event"))
               for sql in after)
    assert len(after) <= 3
    written = list(Event.objects.filter(pk__gt=last_event, run_id=run.pk).order_by("id"))
    assert [event.type for event in written][:2] == ["ledger_charge", "step_completed"]
    entry = LedgerEntry.objects.get(run=run, kind="charge", idempotency_key=attempt.idempotency_key)
    assert written[0].payload["entry"] == entry.pk and written[0].payload["amount"] == entry.amount == 1
    assert Run.objects.get(pk=run.pk).credits_charged == 1
    assert invariants_check() == []


def test_nodes_saved_with_a_new_row_insert_it_and_a_refused_move_takes_it_back(project):
    from django_fsm import ConcurrentTransition

    from core.fsm import save_moved_together
    from runs.models import Step, StepAttempt

    run = running(project, "together", steps=1)
    step, stale = Step.objects.get(run=run), Step.objects.get(run=run)
    step.begin()
    attempt = StepAttempt(run=run, step=step, number=1, idempotency_key=f"together:{step.pk}:1")
    save_moved_together([(step, step.MOVING_FIELDS)], insert=attempt)
    assert attempt.pk is not None and not attempt._state.adding
    assert StepAttempt.objects.get(pk=attempt.pk).idempotency_key == f"together:{step.pk}:1"
    assert Step.objects.get(pk=step.pk).status == "running"
    stale.begin()  # a stale copy: the row is running already
    late = StepAttempt(run=run, step=step, number=2, idempotency_key=f"together:{step.pk}:2")
    with pytest.raises(ConcurrentTransition), transaction.atomic():
        save_moved_together([(stale, stale.MOVING_FIELDS)], insert=late)
    assert list(StepAttempt.objects.filter(step=step).values_list("number", flat=True)) == [1]


def test_an_uneven_plan_spawns_each_step_under_its_own_task_and_each_task_under_its_own_agent(project):
    """The tree is inserted level by level in one statement (PostgreSQL), each row matched to its
    parent by position: agents with different numbers of tasks, tasks with different numbers of steps."""
    from runs.models import Agent, Step

    shape = {"solo": {"only": 1}, "wide": {"first": 3, "second": 1, "third": 2}, "short": {"one": 2}}
    plan = {"agents": [{"name": agent, "tasks": [
        {"name": task, "steps": [{"name": f"{task}-{n}", "tool": "echo", "args": {"text": f"{task}-{n}"}} for n in range(count)]}
        for task, count in tasks.items()]} for agent, tasks in shape.items()]}
    run = services.run_create(project=project, name="uneven", plan=plan, credit_limit=100)
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    steps = Step.objects.filter(run=run).select_related("task__agent").order_by("id")
    spawned = {}
    for step in steps:
        assert step.name.startswith(f"{step.task.name}-") and step.args == {"text": step.name}
        assert step.run_id == step.task.run_id == step.task.agent.run_id == run.pk
        spawned.setdefault(step.task.agent.name, {}).setdefault(step.task.name, []).append(step.sequence)
    assert spawned == {agent: {task: list(range(count)) for task, count in tasks.items()}
                       for agent, tasks in shape.items()}
    assert [agent.sequence for agent in Agent.objects.filter(run=run).order_by("id")] == [0, 1, 2]
    assert [step.pk for step in services.runnable_steps(Run.objects.get(pk=run.pk))] == [
        step.pk for step in steps if step.sequence == 0 and step.task.sequence == 0]


def written(captured) -> list[str]:
    """The statements captured, but for those that make a statement's view on SQLite (once per shape
    and connection: ``core.sql.sqlite_writes``)."""
    return [query["sql"] for query in captured.captured_queries if not query["sql"].startswith("CREATE TEMP ")]


def test_moves_kept_for_the_next_statement_are_seen_by_any_read_and_a_stale_one_refuses_at_its_write(project):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django_fsm import ConcurrentTransition

    from core.fsm import moves_put_off
    from runs.models import Agent, Step, Task

    run = running(project, "kept", steps=1)
    agent, task, step = Agent.objects.get(run=run), Task.objects.get(run=run), Step.objects.get(run=run)
    with transaction.atomic(), moves_put_off(), CaptureQueriesContext(connection) as captured:
        for node in (agent, task, step):
            node.begin()
            node.save_moved(node.MOVING_FIELDS)
        assert captured.captured_queries == []  # kept
        assert Step.objects.get(pk=step.pk).status == "running"  # a read sees them: written just before it
        assert len(written(captured)) == 2  # the three moves in one statement, then the read
        step.complete()
        step.save_moved(step.MOVING_FIELDS)
    assert [type(node).objects.get(pk=node.pk).status for node in (agent, task, step)] == [
        "running", "running", "completed"]

    first, second = Task.objects.get(pk=task.pk), Task.objects.get(pk=task.pk)
    with pytest.raises(ConcurrentTransition), transaction.atomic(), moves_put_off():
        first.complete()
        first.save_moved(first.MOVING_FIELDS)
        second.fail()  # a stale copy of the same row: the first copy's move is written before it is kept
        second.save_moved(second.MOVING_FIELDS)
    assert Task.objects.get(pk=task.pk).status == "running"  # the transaction rolled back with the refusal


def test_a_savepoint_rolled_back_drops_the_moves_kept_inside_it_and_keeps_those_before(project):
    from django_fsm import ConcurrentTransition

    from core.fsm import moves_put_off
    from runs.models import Agent, Task

    run = running(project, "savepoint", steps=1)
    agent, task = Agent.objects.get(run=run), Task.objects.get(run=run)
    with transaction.atomic(), moves_put_off():
        agent.begin()
        agent.save_moved(agent.MOVING_FIELDS)
        with pytest.raises(RuntimeError), transaction.atomic():  # its creation writes the agent's move
            task.begin()
            task.save_moved(task.MOVING_FIELDS)
            raise RuntimeError("refused")
    assert Agent.objects.get(pk=agent.pk).status == "running"
    assert Task.objects.get(pk=task.pk).status == "pending"
    with pytest.raises(ConcurrentTransition), transaction.atomic():
        task.save_moved(task.MOVING_FIELDS)  # the copy whose move was rolled back: refused, not written again
    assert Task.objects.get(pk=task.pk).status == "pending"


def test_a_kept_move_refused_under_another_statement_fails_the_transaction_even_when_that_error_is_caught(project):
    from django_fsm import ConcurrentTransition

    from core.fsm import moves_put_off
    from runs.models import Agent

    run = running(project, "caught", steps=1)
    agent, stale = Agent.objects.get(run=run), Agent.objects.get(run=run)
    agent.begin()
    agent.save_moved(agent.MOVING_FIELDS)
    with pytest.raises(ConcurrentTransition), transaction.atomic(), moves_put_off():
        stale.begin()  # pending → running on a stale copy: kept, refused when written
        stale.save_moved(stale.MOVING_FIELDS)
        try:
            Event.objects.count()  # the kept move is written (and refused) before this read
        except Exception:
            pass  # code that catches its own statement's errors does not swallow the refused move
        event_record(type="run_note", organization_id=project.organization_id, project_id=project.pk,
                     run_id=run.pk, payload={})
    assert not Event.objects.filter(type="run_note", run_id=run.pk).exists()  # rolled back as a whole


def test_a_settlement_that_ends_the_run_writes_every_move_with_its_events_in_one_statement(project):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    run = running(project, "one statement", steps=1)
    step = services.runnable_steps(Run.objects.get(pk=run.pk))[0]
    attempt = services.step_begin(step_id=step.pk)
    with CaptureQueriesContext(connection) as captured:
        assert services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True}).decision == "completed"
    statements = written(captured)
    tables = ('"runs_stepattempt"', '"runs_step"', '"runs_task"', '"runs_agent"', '"runs_runattempt"', '"runs_run"')
    moving = [sql for sql in statements if any(f"UPDATE {table}" in sql for table in tables)]
    assert len(moving) == 1 and all(f"UPDATE {table}" in moving[0] for table in tables)
    assert "INSERT INTO core_event" in moving[0]  # the transaction's last write, before the commit
    assert statements.index(moving[0]) == len(statements) - 2
    assert Run.objects.get(pk=run.pk).status == Run.Status.COMPLETED
    events = list(Event.objects.filter(run_id=run.pk).order_by("id").values_list("type", flat=True))
    assert events[events.index("step_running") + 1:] == [
        "ledger_charge", "step_completed", "task_completed", "agent_completed", "ledger_refund", "run_completed"]
    assert invariants_check() == []


@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's planner")
def test_on_sqlite_a_step_begun_and_settled_reads_no_whole_table_of_nodes(project):
    """On SQLite the run is read with its tree in one statement; joined as a nested group, the
    nodes were read by scanning every run's agents, so a step cost more as the history grew."""
    import re

    from django.test.utils import CaptureQueriesContext

    for n in range(4):
        running(project, f"history-{n}", steps=2)
    run = running(project, "this one", steps=2)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    step = services.runnable_steps(Run.objects.get(pk=run.pk))[0]
    with CaptureQueriesContext(connection) as captured:
        attempt = services.step_begin(step_id=step.pk)
        services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True})
    node_scans = []
    with connection.cursor() as cursor:
        for query in captured.captured_queries:
            if not query["sql"].lstrip().upper().startswith(("SELECT", "WITH", "UPDATE", "INSERT", "DELETE")):
                continue
            cursor.execute("EXPLAIN QUERY PLAN " + query["sql"])
            node_scans += [(row[3], query["sql"][:200]) for row in cursor.fetchall()
                           if re.match(r"SCAN (runs_agent|runs_task|runs_step|g|t|s)\b", row[3])]
    assert node_scans == []
    assert StepAttempt.objects.get(pk=attempt.pk).outcome == "succeeded"


def test_a_settlement_soon_after_a_heartbeat_keeps_it_and_leaves_the_runs_indexed_columns_alone(project):
    """A step settled within ``heartbeat_reuse()`` of the run's last heartbeat writes the run's figures
    and no new heartbeat; on PostgreSQL that update is HOT (no entry in any of the run's indexes)."""
    run = running(project, "in place", steps=2)
    step = services.runnable_steps(Run.objects.get(pk=run.pk))[0]
    attempt = services.step_begin(step_id=step.pk)
    beat = Run.objects.get(pk=run.pk).last_heartbeat
    assert beat is not None
    with transaction.atomic():
        before = _run_updates()  # read in the transaction: the counts of earlier ones may be in it too
        assert services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True}).decision == "completed"
        after = _run_updates()
    if connection.vendor == "postgresql":
        updated, hot = after[0] - before[0], after[1] - before[1]
        assert updated == 1 and hot == 1
    settled = Run.objects.get(pk=run.pk)
    assert settled.last_heartbeat == beat
    assert settled.credits_charged == 1 and settled.status == Run.Status.RUNNING
    assert invariants_check() == []


def _run_updates() -> tuple[int, int]:
    """PostgreSQL: the updates of runs rows this backend counted and has not reported yet, and how
    many of them were HOT (in place, no index entry)."""
    if connection.vendor != "postgresql":
        return 0, 0
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_get_xact_tuples_updated('runs_run'::regclass), "
                       "pg_stat_get_xact_tuples_hot_updated('runs_run'::regclass)")
        return cursor.fetchone()


def test_a_settlement_past_the_heartbeat_reuse_records_a_new_one(project):
    run = running(project, "heard", steps=2)
    step = services.runnable_steps(Run.objects.get(pk=run.pk))[0]
    attempt = services.step_begin(step_id=step.pk)
    old = Run.objects.get(pk=run.pk).last_heartbeat - services.heartbeat_reuse() * 2
    Run.objects.filter(pk=run.pk).update(last_heartbeat=old)
    services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True})
    assert Run.objects.get(pk=run.pk).last_heartbeat > old + services.heartbeat_reuse()


def test_a_short_heartbeat_timeout_shortens_the_reuse(settings):
    settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S = 3  # a run silent for 3 s is stuck: beat every 0.3 s
    assert services.heartbeat_reuse() == timedelta(seconds=0.3)
    settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S = 0
    assert services.heartbeat_reuse() == timedelta(0)
    settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S = 3600
    assert services.heartbeat_reuse() == services.HEARTBEAT_REUSE
