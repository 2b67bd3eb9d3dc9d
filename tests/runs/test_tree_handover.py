"""A run's tree handed from the transaction that left it to the next that settles a step of the
run (PostgreSQL): kept while every node's row version is the one it holds, read again otherwise."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from runs import services
from runs.invariants import invariants_check
from runs.models import Run, Step
from tests.conftest import make_plan

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's row versions")]


@pytest.fixture(autouse=True)
def no_wake_messages(monkeypatch):
    monkeypatch.setattr("jobs.wake._send", lambda count: None)


def running(project, *, steps: int = 3) -> Run:
    run = services.run_create(project=project, name="handover", plan=make_plan(steps=steps))
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    return run


def begun(run: Run, step: Step):
    """``step`` begun the way a ``run_step`` job begins it: (the run its transaction left, the attempt)."""
    left = {}
    with services.run_tree_handed_over(None):
        attempt = services.step_begin(step_id=step.pk, then=lambda locked, *_: left.update(run=locked))
    return left["run"], attempt


def settled(previous: Run | None, attempt) -> tuple[Run, dict]:
    """The attempt settled with ``previous``'s tree handed over: (the run it settled under, its tree's
    steps as that transaction held them)."""
    seen = {}

    def then(locked, outcome):
        seen.update(run=locked, tree=locked.__dict__["_tree"],
                    steps={step.pk: (step.status, step.max_tries) for step in locked.__dict__["_tree"].steps.values()})

    with services.run_tree_handed_over(previous):
        services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": 1}, then=then)
    return seen["run"], seen


def test_the_tree_a_committed_begin_left_is_kept_by_the_settlement(project):
    run = running(project)
    first = Step.objects.filter(run=run).order_by("sequence").first()
    previous, attempt = begun(run, first)
    locked, seen = settled(previous, attempt)
    assert seen["tree"] is previous.__dict__["_tree"]  # the same objects: no node read again
    assert seen["steps"][first.pk][0] == "completed"
    assert {step.pk: (step.status, step.max_tries) for step in Step.objects.filter(run=run)} == seen["steps"]
    assert all(step.run is locked for step in seen["tree"].steps.values() if "run" in step._state.fields_cache)
    assert invariants_check() == []


def test_a_node_another_transaction_changed_meanwhile_is_read_again(project):
    run = running(project)
    first, second = Step.objects.filter(run=run).order_by("sequence")[:2]
    previous, attempt = begun(run, first)
    Step.objects.filter(pk=second.pk).update(max_tries=7)  # a write that did not go through the run's lock
    _, seen = settled(previous, attempt)
    assert seen["tree"] is not previous.__dict__["_tree"]
    assert seen["steps"][second.pk] == ("pending", 7)


def test_a_tree_whose_transaction_rolled_back_is_not_handed_over(project):
    run = running(project)
    first = Step.objects.filter(run=run).order_by("sequence").first()
    left = {}
    with pytest.raises(RuntimeError), transaction.atomic():
        services.step_begin(step_id=first.pk, then=lambda locked, *_: left.update(run=locked))
        raise RuntimeError("the begin does not commit")
    previous, attempt = begun(run, first)
    _, seen = settled(left["run"], attempt)  # the tree of the begin that rolled back: not that one
    assert seen["tree"] is not left["run"].__dict__["_tree"] and seen["steps"][first.pk][0] == "completed"
    assert seen["tree"] is not previous.__dict__["_tree"]  # not handed over: read


def test_a_node_with_a_move_not_written_is_read_again(project):
    run = running(project)
    first, second = Step.objects.filter(run=run).order_by("sequence")[:2]
    previous, attempt = begun(run, first)
    held = previous.__dict__["_tree"].steps[second.pk]
    held.begin()  # moved in memory only
    _, seen = settled(previous, attempt)
    assert seen["tree"] is not previous.__dict__["_tree"] and seen["steps"][second.pk][0] == "pending"


def test_a_chained_run_completes_with_each_step_charged_once_when_another_branch_moves_between_its_steps(
        project):
    """Two tasks in parallel: the other task's steps move between this chain's transactions, so the
    handed-over tree is refused and read again each time; the run ends as it would without."""
    from jobs.executor import job_run_claimed
    from jobs.services import job_claim

    run = services.run_create(project=project, name="branches", plan=make_plan(tasks=2, steps=3,
                                                                              parallelism_mode="parallel"))
    services.run_start(run_id=run.pk)
    while True:
        job = job_claim(worker="w1")
        if job is None:
            break
        other = job_claim(worker="w2")  # a second worker's job, run between this one's steps
        job_run_claimed(job, worker="w1")
        if other is not None:
            job_run_claimed(other, worker="w2")
    run.refresh_from_db()
    assert run.status == Run.Status.COMPLETED
    assert all(step.status == "completed" and step.attempts == 1 for step in Step.objects.filter(run=run))
    assert invariants_check() == []
    assert connection.vendor == "postgresql"
