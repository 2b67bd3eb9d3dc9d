"""Real races on PostgreSQL: threads with their own connections, released together by a barrier.

Every transition service locks the run row (``SELECT ... FOR UPDATE``) and re-checks the
state, so when two workers race exactly one wins; the loser gets ``InvalidTransition`` or,
where the idempotency rules say so, a no-op (a late step result is discarded). Whoever wins,
the ledger holds one reservation and one settlement, and the invariants hold.

Note on "complete vs fail": a running run whose agents are all done completes in the same
transaction that finishes its last step (``_settle_run_if_done``), so services never leave a
run ``running`` with every agent done. The race is therefore run where completion really
happens: the last step's ``step_attempt_succeed`` (which completes the run) against
``run_fail``, and ``run_mark_running`` of a resuming run whose agents all completed while it
was paused (which completes it) against ``run_fail``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import pytest
from django.db import connection

from billing.models import CreditAccount, LedgerEntry
from core.errors import DomainError, InvalidTransition, ValidationFailed
from core.models import Event
from runs import services
from runs.invariants import invariants_check
from runs.models import Run, RunAttempt, StepAttempt
from tests.conftest import make_plan

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ROUNDS = 20  # the races the design names (complete/fail, cancel/complete, start)
EXTRA_ROUNDS = 6  # the other races (three-way, refunds)


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def race(*calls: Callable[[], Any]) -> list[Outcome]:
    """Run ``calls`` at the same moment, each in its own thread and database connection."""
    barrier = threading.Barrier(len(calls))
    outcomes = [Outcome() for _ in calls]

    def work(index: int, call: Callable[[], Any]) -> None:
        try:
            connection.ensure_connection()  # connect before the barrier: start the race, not the handshake
            barrier.wait(timeout=30)
            outcomes[index].value = call()
        except BaseException as exc:  # noqa: BLE001 - reported and asserted by the caller
            outcomes[index].error = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=work, args=(i, call), daemon=True) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a racing worker hung"
    for outcome in outcomes:
        assert outcome.error is None or isinstance(outcome.error, DomainError), repr(outcome.error)
    return outcomes


def entries(run_id: int, **filters) -> list[LedgerEntry]:
    return list(LedgerEntry.objects.filter(run_id=run_id, **filters))


def running_with_step_in_flight(project) -> tuple[Run, StepAttempt]:
    """A running run whose only step has an attempt in flight: finishing it completes the run."""
    run = services.run_create(project=project, name="race", plan=make_plan())
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    step = services.runnable_steps(Run.objects.get(pk=run.pk))[0]
    return run, services.step_begin(step_id=step.pk)


def resuming_with_every_agent_done(project) -> Run:
    """Paused while its last step ran; the step finished meanwhile; then resumed."""
    run, attempt = running_with_step_in_flight(project)
    services.run_pause(run_id=run.pk)
    assert services.step_attempt_succeed(attempt_id=attempt.pk).decision == "completed"
    services.run_resume(run_id=run.pk)
    run.refresh_from_db()
    assert run.status == Run.Status.RESUMING
    assert not run.agents.exclude(status="completed").exists()
    return run


def assert_settled_once(run: Run, *, charged: int) -> None:
    """One reservation, ``charged`` credits charged, one settlement of the rest, invariants intact."""
    run.refresh_from_db()
    reserves = entries(run.pk, kind=LedgerEntry.Kind.RESERVE)
    settles = entries(run.pk, kind=LedgerEntry.Kind.REFUND, idempotency_key="attempt:1:settle")
    charges = entries(run.pk, kind=LedgerEntry.Kind.CHARGE)
    assert [e.amount for e in reserves] == [run.credit_limit]
    assert sum(e.amount for e in charges) == charged
    assert [e.amount for e in settles] == [run.credit_limit - charged]
    assert len(entries(run.pk)) == 2 + len(charges)
    assert (run.credits_reserved, run.credits_charged, run.credits_refunded) == (
        run.credit_limit, charged, run.credit_limit - charged)
    terminal_events = Event.objects.filter(run_id=run.pk, type__in=["run_completed", "run_failed", "run_cancelled"])
    assert [e.type for e in terminal_events] == [f"run_{run.status}"]
    assert RunAttempt.objects.get(run=run, number=1).outcome == run.status


def assert_invariants() -> None:
    assert [str(v) for v in invariants_check()] == []


def test_last_step_success_races_run_fail_one_winner(project):
    winners = {"completed": 0, "failed": 0}
    for _ in range(ROUNDS):
        run, attempt = running_with_step_in_flight(project)
        succeed, fail = race(
            lambda: services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True}),
            lambda: services.run_fail(run_id=run.pk, code="worker_lost", message="racing failure"),
        )
        run.refresh_from_db()
        assert succeed.ok, succeed.error
        if run.status == Run.Status.COMPLETED:
            assert succeed.value.decision == "completed"
            assert isinstance(fail.error, InvalidTransition) and fail.error.current == Run.Status.COMPLETED
            assert_settled_once(run, charged=1)
        else:
            assert run.status == Run.Status.FAILED and run.last_error_code == "worker_lost"
            assert fail.ok
            assert succeed.value.decision in ("discarded", "replayed")  # a late result changes nothing
            assert StepAttempt.objects.get(pk=attempt.pk).outcome == StepAttempt.Outcome.DISCARDED
            assert_settled_once(run, charged=0)
        winners[run.status] += 1
    assert sum(winners.values()) == ROUNDS
    assert_invariants()


def test_completion_on_resume_races_run_fail_one_winner(project):
    for _ in range(ROUNDS):
        run = resuming_with_every_agent_done(project)
        mark_running, fail = race(
            lambda: services.run_mark_running(run_id=run.pk),
            lambda: services.run_fail(run_id=run.pk, code="resume_timeout", message="racing failure"),
        )
        run.refresh_from_db()
        assert run.status in (Run.Status.COMPLETED, Run.Status.FAILED)
        loser = fail if run.status == Run.Status.COMPLETED else mark_running
        winner = mark_running if run.status == Run.Status.COMPLETED else fail
        assert winner.ok, winner.error
        assert isinstance(loser.error, InvalidTransition) and loser.error.current == run.status
        assert_settled_once(run, charged=1)  # the step succeeded (and was charged) before the race
    assert_invariants()


def test_run_cancel_races_completion_one_winner(project):
    for _ in range(ROUNDS):
        run, attempt = running_with_step_in_flight(project)
        cancel, succeed = race(
            lambda: services.run_cancel(run_id=run.pk, reason="operator cancel"),
            lambda: services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True}),
        )
        run.refresh_from_db()
        assert succeed.ok, succeed.error
        if run.status == Run.Status.COMPLETED:
            assert succeed.value.decision == "completed"
            assert isinstance(cancel.error, InvalidTransition) and cancel.error.current == Run.Status.COMPLETED
            assert_settled_once(run, charged=1)
        else:
            assert run.status == Run.Status.CANCELLED
            assert cancel.ok
            assert succeed.value.decision in ("discarded", "replayed")
            assert_settled_once(run, charged=0)
    assert_invariants()


def test_run_cancel_races_run_fail_and_run_pause(project):
    for _ in range(EXTRA_ROUNDS):
        run, attempt = running_with_step_in_flight(project)
        cancel, fail, pause = race(
            lambda: services.run_cancel(run_id=run.pk, reason="operator cancel"),
            lambda: services.run_fail(run_id=run.pk, code="worker_lost", message="racing failure"),
            lambda: services.run_pause(run_id=run.pk),
        )
        run.refresh_from_db()
        # One of cancel or fail ends the run (a pause in between may or may not have happened first).
        assert run.status in (Run.Status.CANCELLED, Run.Status.FAILED)
        ended_by = cancel if run.status == Run.Status.CANCELLED else fail
        other = fail if run.status == Run.Status.CANCELLED else cancel
        assert ended_by.ok, ended_by.error
        assert isinstance(other.error, InvalidTransition)
        assert pause.ok or isinstance(pause.error, InvalidTransition)
        assert_settled_once(run, charged=0)
    assert_invariants()


def test_concurrent_run_start_reserves_once(org_factory):
    _, project, _ = org_factory(credits=100)
    run = services.run_create(project=project, name="start race", plan=make_plan())
    outcomes = race(*[lambda: services.run_start(run_id=run.pk) for _ in range(20)])
    assert all(outcome.ok for outcome in outcomes), [o.error for o in outcomes if not o.ok]
    run.refresh_from_db()
    assert run.status == Run.Status.PENDING
    assert [e.amount for e in entries(run.pk, kind=LedgerEntry.Kind.RESERVE)] == [run.credit_limit]
    assert len(entries(run.pk)) == 1
    assert RunAttempt.objects.filter(run=run).count() == 1
    assert Event.objects.filter(run_id=run.pk, type="run_pending").count() == 1
    account = CreditAccount.objects.get(organization_id=project.organization_id)
    assert (account.balance, account.reserved) == (100, run.credit_limit)
    assert_invariants()


def test_concurrent_starts_of_different_runs_never_overdraw(org_factory):
    _, project, _ = org_factory(credits=10)
    runs = [services.run_create(project=project, name=f"r{i}", plan=make_plan(), credit_limit=3) for i in range(6)]
    outcomes = race(*[lambda run=run: services.run_start(run_id=run.pk) for run in runs])
    started = [o for o in outcomes if o.ok]
    refused = [o for o in outcomes if not o.ok]
    assert len(started) == 3 and len(refused) == 3  # 3 × 3 credits fit in 10, a fourth does not
    assert all(o.error.code == "insufficient_credits" for o in refused)
    account = CreditAccount.objects.get(organization_id=project.organization_id)
    assert (account.balance, account.reserved) == (10, 9)
    assert Run.objects.filter(status=Run.Status.PENDING).count() == 3
    assert Run.objects.filter(status=Run.Status.CREATED).count() == 3
    assert_invariants()


def completed_run(project) -> Run:
    run = services.run_create(project=project, name="refund race", plan=make_plan(steps=2))
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    while steps := services.runnable_steps(Run.objects.get(pk=run.pk)):
        services.step_attempt_succeed(attempt_id=services.step_begin(step_id=steps[0].pk).pk)
    run.refresh_from_db()
    assert run.status == Run.Status.COMPLETED and run.credits_charged == 2
    return run


def test_concurrent_full_refunds_give_back_only_what_was_charged(project):
    for round_number in range(EXTRA_ROUNDS):
        run = completed_run(project)
        first, second = race(
            lambda: services.run_refund(run_id=run.pk, reason="a", idempotency_key=f"a{round_number}"),
            lambda: services.run_refund(run_id=run.pk, reason="b", idempotency_key=f"b{round_number}"),
        )
        winner, loser = (first, second) if first.ok else (second, first)
        assert winner.value == 2
        assert isinstance(loser.error, ValidationFailed)
        run.refresh_from_db()
        assert (run.credits_charged, run.credits_refunded) == (0, run.credits_reserved)
        assert len(entries(run.pk, kind=LedgerEntry.Kind.REFUND, source=LedgerEntry.Source.CHARGE)) == 1
    assert_invariants()


def test_concurrent_refunds_with_one_key_refund_once(project):
    for round_number in range(EXTRA_ROUNDS):
        run = completed_run(project)
        outcomes = race(*[
            lambda: services.run_refund(run_id=run.pk, amount=1, reason="dup", idempotency_key=f"k{round_number}")
            for _ in range(3)
        ])
        assert sorted(o.value for o in outcomes) == [0, 0, 1], [o.error for o in outcomes]
        run.refresh_from_db()
        assert run.credits_charged == 1
        assert len(entries(run.pk, kind=LedgerEntry.Kind.REFUND, source=LedgerEntry.Source.CHARGE)) == 1
    assert_invariants()
