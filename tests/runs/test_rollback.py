"""A failure after a transition but before commit leaves nothing behind (DESIGN STYLE §1–2).

The FSM call, the ledger entry, the event and the audit row are written in one transaction:
an exception anywhere before commit rolls all of them back, the worker's job queued with the move
among them.
"""

from __future__ import annotations

import types

import pytest
from django.db import transaction

from billing.models import CreditAccount, LedgerEntry
from core.models import AuditRecord, Event
from jobs.models import Job
from runs import outbox, services
from runs.invariants import invariants_check
from runs.models import Agent, Run, RunAttempt, Step, StepAttempt, Task
from tests.conftest import make_plan


class Boom(Exception):
    pass


def dispatched(run: Run) -> list[str]:
    """The states of the run's jobs (a worker's, queued in the transaction that moved it: a start's
    ``run_step`` job, a resume's or a retry's ``run_tick``)."""
    return list(Job.objects.filter(run_id=run.pk).order_by("pk").values_list("state", flat=True))


@pytest.fixture
def operator(django_user_model):
    return django_user_model.objects.create_user(username="rollback-operator", is_staff=True)


def world(run: Run) -> dict:
    return {
        "run": Run.objects.filter(pk=run.pk).values().get(),
        "ledger": list(LedgerEntry.objects.values_list("pk", flat=True)),
        "events": list(Event.objects.values_list("pk", flat=True)),
        "jobs": list(Job.objects.values_list("pk", "state")),
        "audit": list(AuditRecord.objects.values_list("pk", flat=True)),
        "attempts": list(RunAttempt.objects.filter(run=run).values()),
        "nodes": [list(model.objects.filter(run=run).order_by("pk").values_list("pk", "status"))
                  for model in (Agent, Task, Step)],
        "step_attempts": list(StepAttempt.objects.filter(run=run).values_list("pk", "outcome", "cost")),
        "account": CreditAccount.objects.filter(organization_id=run.organization_id).values().get(),
    }


def explode_after(monkeypatch, name: str, *, when=lambda *args, **kwargs: True):
    """Make ``runs.services.<name>`` do its work and then raise ``Boom`` (when ``when`` says so),
    wherever in the package it is called from."""
    modules = [module for module in vars(services).values()
               if isinstance(module, types.ModuleType) and module.__name__.startswith("runs.services.")
               and hasattr(module, name)]
    original = getattr(modules[0], name)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        if when(*args, **kwargs):
            raise Boom(f"after {name}")
        return result

    for module in modules:
        monkeypatch.setattr(module, name, wrapper)


def created_run(project) -> Run:
    return services.run_create(project=project, name="rollback", plan=make_plan(steps=2))


def running_run(project) -> Run:
    run = created_run(project)
    services.run_start(run_id=run.pk)
    return services.run_mark_running(run_id=run.pk)


def test_start_failing_after_its_transition_leaves_no_reservation(project, monkeypatch, operator,
                                                                  django_capture_on_commit_callbacks):
    run = created_run(project)
    before = world(run)
    explode_after(monkeypatch, "_record_run_change")

    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with pytest.raises(Boom):
            services.run_start(run_id=run.pk, actor=operator)

    assert world(run) == before
    assert Run.objects.get(pk=run.pk).status == Run.Status.CREATED
    assert not LedgerEntry.objects.filter(run=run).exists()
    assert not RunAttempt.objects.filter(run=run).exists()
    assert callbacks == [] and dispatched(run) == []
    assert invariants_check() == []

    monkeypatch.undo()  # the same start, without the failure, goes through once
    with django_capture_on_commit_callbacks(execute=True):
        services.run_start(run_id=run.pk, actor=operator)
    assert dispatched(run) == ["queued"]
    assert LedgerEntry.objects.filter(run=run, kind="reserve").count() == 1


def test_cancel_failing_on_its_event_leaves_the_run_running(project, monkeypatch):
    run = running_run(project)
    in_flight = services.step_begin(step_id=services.runnable_steps(run)[0].pk)
    before = world(run)

    def refuse_run_events(**kwargs):
        if kwargs["type"].startswith("run_"):
            raise Boom("event store down")
        return original(**kwargs)

    def refuse_run_event_rows(rows):  # a transaction's events, written together at its end
        if any(row["type"].startswith("run_") for row in rows):
            raise Boom("event store down")
        return original_rows(rows)

    original, original_rows = outbox.event_record, outbox.events_record
    monkeypatch.setattr("runs.outbox.event_record", refuse_run_events)
    monkeypatch.setattr("runs.outbox.events_record", refuse_run_event_rows)
    with pytest.raises(Boom):
        services.run_cancel(run_id=run.pk, reason="user asked")

    assert world(run) == before
    run.refresh_from_db()
    assert run.status == Run.Status.RUNNING and run.cancelled_at is None
    assert not LedgerEntry.objects.filter(run=run, kind="refund").exists()
    assert StepAttempt.objects.get(pk=in_flight.pk).outcome == StepAttempt.Outcome.RUNNING
    assert invariants_check() == []


@pytest.mark.parametrize("action", ["run_fail", "run_pause", "run_retry", "run_complete_by_step"])
def test_every_transition_rolls_back_as_a_whole(project, monkeypatch, action, django_capture_on_commit_callbacks):
    run = running_run(project)
    if action == "run_retry":
        services.run_fail(run_id=run.pk, code="worker_lost", message="gone")
    last_step = None
    if action == "run_complete_by_step":
        steps = services.runnable_steps(Run.objects.get(pk=run.pk))
        first = services.step_begin(step_id=steps[0].pk)
        services.step_attempt_succeed(attempt_id=first.pk)
        last_step = services.step_begin(step_id=services.runnable_steps(Run.objects.get(pk=run.pk))[0].pk)
    before = world(run)
    explode_after(monkeypatch, "_record_run_change")

    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with pytest.raises(Boom):
            if action == "run_fail":
                services.run_fail(run_id=run.pk, code="operator_abort", message="stop")
            elif action == "run_pause":
                services.run_pause(run_id=run.pk)
            elif action == "run_retry":
                services.run_retry(run_id=run.pk)
            else:  # the last step's result completes the run, then the run's event fails
                services.step_attempt_succeed(attempt_id=last_step.pk)

    assert world(run) == before  # the retry's tick among what is not there
    assert callbacks == []
    assert invariants_check() == []


def test_an_outer_transaction_that_fails_takes_the_transition_with_it(project, django_capture_on_commit_callbacks):
    run = created_run(project)
    before = world(run)

    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with pytest.raises(Boom):
            with transaction.atomic():
                started = services.run_start(run_id=run.pk)
                assert started.status == Run.Status.PENDING
                assert LedgerEntry.objects.filter(run=run).count() == 1
                assert dispatched(run) == ["queued"]
                raise Boom("the caller failed after the service returned")

    assert world(run) == before
    assert callbacks == [] and dispatched(run) == []


def test_a_step_result_failing_before_commit_is_not_charged_and_can_be_delivered_again(project, monkeypatch):
    run = running_run(project)
    attempt = services.step_begin(step_id=services.runnable_steps(run)[0].pk)
    before = world(run)
    explode_after(monkeypatch, "_after_step_done")

    with pytest.raises(Boom):
        services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True})

    assert world(run) == before
    assert not LedgerEntry.objects.filter(run=run, kind="charge").exists()
    assert StepAttempt.objects.get(pk=attempt.pk).outcome == StepAttempt.Outcome.RUNNING

    monkeypatch.undo()  # the worker delivers the same result again: recorded once
    assert services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True}).decision == "completed"
    assert services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True}).decision == "replayed"
    assert LedgerEntry.objects.filter(run=run, kind="charge").count() == 1
    assert invariants_check() == []


def test_an_error_in_the_automatic_retry_rolls_back_the_whole_step_result(project, monkeypatch):
    """Only a refused reservation is absorbed by the retry's savepoint; any other error undoes the
    step result that caused the failure, so the worker can deliver it again."""
    plan = {"agents": [
        {"name": "a0", "tasks": [{"name": "t0", "steps": [
            {"name": "s0", "tool": "fail", "args": {"mode": "retryable", "times": 9}}]}]},
        {"name": "a1", "tasks": [{"name": "t0", "steps": [{"name": "s0", "tool": "echo", "args": {"text": "x"}}]}]},
    ]}
    run = services.run_create(project=project, name="retrying", plan=plan, failure_mode="retry")
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    step = Step.objects.get(run=run, task__agent__name="a0")
    for _ in range(2):  # two transient failures; the third exhausts the step and fails the run
        attempt = services.step_begin(step_id=step.pk)
        services.step_attempt_fail(attempt_id=attempt.pk, code="drill_retryable", message="x", retryable=True)
        step.refresh_from_db()
        monkeypatch.setattr("django.utils.timezone.now", lambda moment=step.not_before: moment)
    attempt = services.step_begin(step_id=step.pk)
    before = world(run)
    explode_after(monkeypatch, "_record_run_change",
                  when=lambda run, **kwargs: kwargs.get("action") == "retry")

    with pytest.raises(Boom):
        services.step_attempt_fail(attempt_id=attempt.pk, code="drill_retryable", message="x", retryable=True)

    # The exception escaped the whole step service: nothing of it stays, not even the failure.
    assert world(run) == before
    run.refresh_from_db()
    assert (run.status, run.attempt_number) == (Run.Status.RUNNING, 1)
    assert StepAttempt.objects.get(pk=attempt.pk).outcome == StepAttempt.Outcome.RUNNING
    assert invariants_check() == []

    monkeypatch.undo()  # the worker delivers the same failure again: now the retry goes through
    services.step_attempt_fail(attempt_id=attempt.pk, code="drill_retryable", message="x", retryable=True)
    run.refresh_from_db()
    assert (run.status, run.attempt_number) == (Run.Status.RETRYING, 2)
    assert invariants_check() == []


def test_resume_and_retry_queue_the_runs_tick_with_their_move(project, django_capture_on_commit_callbacks):
    run = running_run(project)
    services.run_pause(run_id=run.pk)
    before = dispatched(run)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        services.run_resume(run_id=run.pk)
        assert dispatched(run) == [*before, "queued"]  # in the resume's transaction
    assert callbacks  # the workers' wake-up (and the transition's log line) wait for the commit

    services.run_mark_running(run_id=run.pk)
    services.run_fail(run_id=run.pk, code="worker_lost", message="gone")
    services.run_retry(run_id=run.pk)
    assert dispatched(run) == [*before, "queued", "queued"]
