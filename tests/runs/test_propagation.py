"""Driving a run's steps and propagating failures (seed 001 §3, §5, §6.1; DESIGN §2.2).

A test plays the worker: it asks ``runnable_steps`` what may start, begins steps with
``step_begin`` and reports results with ``step_attempt_succeed`` / ``step_attempt_fail``.
Every scenario ends with the invariant checker finding nothing.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import LedgerEntry
from billing.selectors import account_balance, ledger_totals
from core.errors import InvalidTransition
from core.models import AuditRecord, Event
from jobs.registry import RetryPolicy
from runs import services
from runs.invariants import invariants_check
from runs.models import LIVE_NODE_STATES, Agent, NodeStatus, Run, RunAttempt, Step, StepAttempt, Task

FAILED, COMPLETED, SKIPPED, CANCELLED, PENDING, RUNNING, PAUSED = (
    NodeStatus.FAILED, NodeStatus.COMPLETED, NodeStatus.SKIPPED, NodeStatus.CANCELLED, NodeStatus.PENDING,
    NodeStatus.RUNNING, NodeStatus.PAUSED)


# --- plans ----------------------------------------------------------------------------------

def echo(name: str) -> dict:
    return {"name": name, "tool": "echo", "args": {"text": name}}


def drill(name: str, mode: str = "fatal", times: int = 1) -> dict:
    return {"name": name, "tool": "fail", "args": {"mode": mode, "times": times}}


def task(name: str, *steps: dict, **options) -> dict:
    return {"name": name, **options, "steps": list(steps)}


def agent(name: str, *tasks: dict, **options) -> dict:
    return {"name": name, **options, "tasks": list(tasks)}


def plan(*agents: dict, **options) -> dict:
    return {**options, "agents": list(agents)}


# --- playing the worker ---------------------------------------------------------------------

def running_run(project, the_plan: dict, **options) -> Run:
    run = services.run_create(project=project, name="propagation", plan=the_plan, **options)
    services.run_start(run_id=run.pk)
    return services.run_mark_running(run_id=run.pk)


def fresh(run_id: int) -> Run:
    return Run.objects.get(pk=run_id)


def node(run_id: int, path: str, *, attempt: int | None = None):
    """``"a0"`` → agent, ``"a0/t0"`` → task, ``"a0/t0/s0"`` → step of the run's current attempt."""
    number = attempt or fresh(run_id).attempt_number
    parts = path.split("/")
    if len(parts) == 1:
        return Agent.objects.get(run_id=run_id, attempt_number=number, name=parts[0])
    if len(parts) == 2:
        return Task.objects.get(run_id=run_id, agent__attempt_number=number, agent__name=parts[0], name=parts[1])
    return Step.objects.get(run_id=run_id, task__agent__attempt_number=number, task__agent__name=parts[0],
                            task__name=parts[1], name=parts[2])


def status(run_id: int, path: str, *, attempt: int | None = None) -> str:
    return node(run_id, path, attempt=attempt).status


def runnable(run_id: int, *, now=None, agent: str | None = None) -> list[str]:
    steps = services.runnable_steps(fresh(run_id), now=now)
    paths = sorted(f"{s.task.agent.name}/{s.task.name}/{s.name}" for s in steps)
    return [p for p in paths if agent is None or p.startswith(f"{agent}/")]


def begin(run_id: int, path: str) -> StepAttempt:
    return services.step_begin(step_id=node(run_id, path).pk)


def succeed(attempt: StepAttempt) -> services.StepOutcome:
    return services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True})


def fail(attempt: StepAttempt, *, retryable: bool = False, code: str = "drill_fatal",
         message: str = "drill failure") -> services.StepOutcome:
    return services.step_attempt_fail(attempt_id=attempt.pk, code=code, message=message, retryable=retryable)


def run_step(run_id: int, path: str) -> services.StepOutcome:
    outcome = succeed(begin(run_id, path))
    assert outcome.decision == "completed"
    return outcome


def exhaust(run_id: int, path: str, clock, *, message: str = "flaky") -> services.StepOutcome:
    """Fail a step with retryable errors until its tries run out, waiting out each backoff."""
    for _ in range(10):
        outcome = fail(begin(run_id, path), retryable=True, code="drill_retryable", message=message)
        if outcome.decision != "retry":
            return outcome
        clock.advance(milliseconds=outcome.delay_ms)
    raise AssertionError(f"{path} kept being retried")


def run_events(run_id: int) -> list[str]:
    return list(Event.objects.filter(run_id=run_id, type__startswith="run_").order_by("id")
                .values_list("type", flat=True))


def assert_settled(run: Run) -> None:
    """``charged + refunded == reserved`` for the run and each attempt, as the ledger says."""
    assert run.credits_charged + run.credits_refunded == run.credits_reserved
    assert ledger_totals(run_id=run.pk) == {"reserved": run.credits_reserved, "charged": run.credits_charged,
                                            "refunded": run.credits_refunded}
    for attempt in RunAttempt.objects.filter(run=run):
        assert attempt.credits_charged + attempt.credits_refunded == attempt.credits_reserved


def assert_no_live_nodes(run_id: int) -> None:
    for model in (Agent, Task, Step):
        assert not model.objects.filter(run_id=run_id, status__in=LIVE_NODE_STATES).exists(), model.__name__
    assert not StepAttempt.objects.filter(run_id=run_id, outcome=StepAttempt.Outcome.RUNNING).exists()


def assert_invariants() -> None:
    assert [str(v) for v in invariants_check()] == []


@pytest.fixture
def clock(monkeypatch):
    """A frozen ``timezone.now`` that a test moves forward by hand (no sleeping)."""

    class Clock:
        def __init__(self) -> None:
            self.now = timezone.now()

        def __call__(self):
            return self.now

        def advance(self, **delta) -> None:
            self.now += timedelta(**delta)

    frozen = Clock()
    monkeypatch.setattr(timezone, "now", frozen)
    return frozen


# --- fail-fast (the default) ----------------------------------------------------------------

def test_fail_fast_step_failure_fails_task_agent_and_run(project):
    run = running_run(project, plan(
        agent("a0", task("t0", echo("s0"), echo("s1")), task("t1", echo("s0"))),
        agent("a1", task("t0", echo("s0"), echo("s1"))),
    ))
    assert runnable(run.pk) == ["a0/t0/s0", "a1/t0/s0"]
    in_flight = begin(run.pk, "a1/t0/s0")

    outcome = fail(begin(run.pk, "a0/t0/s0"), message="tool crashed")

    assert (outcome.decision, outcome.error_code) == ("failed", "drill_fatal")
    run = fresh(run.pk)
    assert run.status == Run.Status.FAILED
    assert run.last_error_code == "drill_fatal"
    assert run.last_error == "agent a0: task t0: step s0: tool crashed"
    assert [status(run.pk, p) for p in ("a0/t0/s0", "a0/t0/s1", "a0/t0", "a0/t1", "a0")] == [
        FAILED, SKIPPED, FAILED, SKIPPED, FAILED]
    assert status(run.pk, "a1") == CANCELLED  # the other agent was running: terminated
    assert_no_live_nodes(run.pk)
    assert StepAttempt.objects.get(pk=in_flight.pk).outcome == StepAttempt.Outcome.DISCARDED
    # 5 steps × 3 tries reserved; the failed attempt cost 1; the rest went back.
    assert (run.credits_reserved, run.credits_charged, run.credits_refunded) == (15, 1, 14)
    assert_settled(run)
    assert account_balance(organization_id=project.organization_id)["reserved"] == 0
    types = list(Event.objects.filter(run_id=run.pk).values_list("type", flat=True))
    for expected in ("step_failed", "task_failed", "agent_failed", "run_failed"):
        assert expected in types
    assert run_events(run.pk)[-1] == "run_failed"
    assert runnable(run.pk) == []
    assert_invariants()


# --- task level -------------------------------------------------------------------------------

def test_task_continue_skips_the_failed_step_and_completes(project):
    run = running_run(project, plan(agent("a0", task("t0", drill("s0"), echo("s1"), failure_mode="continue"))))
    assert fail(begin(run.pk, "a0/t0/s0")).decision == "failed"
    assert status(run.pk, "a0/t0") == RUNNING
    assert runnable(run.pk) == ["a0/t0/s1"]
    run_step(run.pk, "a0/t0/s1")
    run = fresh(run.pk)
    assert (status(run.pk, "a0/t0/s0"), status(run.pk, "a0/t0"), run.status) == (FAILED, COMPLETED,
                                                                                 Run.Status.COMPLETED)
    assert (run.credits_charged, run.credits_refunded) == (2, 4)
    assert_settled(run)
    assert_invariants()


def test_task_continue_with_no_step_completed_is_skipped_and_does_not_propagate(project):
    run = running_run(project, plan(agent("a0", task("t0", drill("s0"), failure_mode="continue"),
                                          task("t1", echo("s0")))))
    fail(begin(run.pk, "a0/t0/s0"))
    assert status(run.pk, "a0/t0") == SKIPPED
    assert status(run.pk, "a0") == RUNNING
    run_step(run.pk, "a0/t1/s0")
    assert (status(run.pk, "a0"), fresh(run.pk).status) == (COMPLETED, Run.Status.COMPLETED)
    assert_settled(fresh(run.pk))
    assert_invariants()


def test_a_run_whose_only_task_was_skipped_fails_with_no_agent_completed(project):
    run = running_run(project, plan(agent("a0", task("t0", drill("s0"), failure_mode="continue"))))
    fail(begin(run.pk, "a0/t0/s0"))
    run = fresh(run.pk)
    assert (status(run.pk, "a0/t0"), status(run.pk, "a0")) == (SKIPPED, SKIPPED)
    assert (run.status, run.last_error_code) == (Run.Status.FAILED, "no_agent_completed")
    assert_settled(run)
    assert_invariants()


def test_task_retry_restarts_all_its_steps_up_to_three_times_then_fails(project, clock):
    # a1 stays healthy: one failed agent of two does not call for a re-plan (seed 001 §6.4).
    run = running_run(project, plan(agent("a0", task("t0", echo("s0"), drill("s1", mode="retryable", times=99),
                                                     failure_mode="retry")),
                                    agent("a1", task("t0", echo("s0")))), credit_limit=100)
    for retry in range(1, 4):
        run_step(run.pk, "a0/t0/s0")
        assert exhaust(run.pk, "a0/t0/s1", clock).decision == "failed"
        t0 = node(run.pk, "a0/t0")
        assert (t0.status, t0.retry_count) == (PENDING, retry)
        # The whole task starts over: its first step is runnable again, the second waits.
        assert runnable(run.pk, agent="a0") == ["a0/t0/s0"]
        assert (status(run.pk, "a0/t0/s0"), status(run.pk, "a0/t0/s1")) == (PENDING, PENDING)
        assert node(run.pk, "a0/t0/s1").tries_this_round == 0
        assert fresh(run.pk).status == Run.Status.RUNNING
    run_step(run.pk, "a0/t0/s0")
    exhaust(run.pk, "a0/t0/s1", clock)

    run = fresh(run.pk)
    assert (status(run.pk, "a0/t0"), status(run.pk, "a0"), run.status) == (FAILED, FAILED, Run.Status.FAILED)
    assert run.last_error_code == "drill_retryable"
    assert node(run.pk, "a0/t0").retry_count == 3
    # 4 rounds: s0 once per round, s1 three tries per round; every attempt was paid for once.
    assert (node(run.pk, "a0/t0/s0").attempts, node(run.pk, "a0/t0/s1").attempts) == (4, 12)
    assert run.credits_charged == 16
    assert_settled(run)
    assert_no_live_nodes(run.pk)
    assert_invariants()


def test_task_retry_succeeds_on_a_later_round(project, clock):
    run = running_run(project, plan(agent("a0", task("t0", echo("s0"), drill("s1", mode="retryable"),
                                                     failure_mode="retry"))), credit_limit=20)
    run_step(run.pk, "a0/t0/s0")
    exhaust(run.pk, "a0/t0/s1", clock)
    assert node(run.pk, "a0/t0").retry_count == 1
    run_step(run.pk, "a0/t0/s0")
    run_step(run.pk, "a0/t0/s1")
    run = fresh(run.pk)
    assert run.status == Run.Status.COMPLETED
    assert (run.credits_reserved, run.credits_charged, run.credits_refunded) == (20, 6, 14)
    assert_settled(run)
    assert_invariants()


@pytest.mark.parametrize("level", ["task", "agent", "run"])
def test_retry_modes_never_retry_a_fatal_failure(project, level):
    """Seed 001 §3.4 rule 3: the retry mode is for transient errors; a fatal one fails at once."""
    options = {"failure_mode": "retry"}
    the_plan = plan(agent("a0", task("t0", drill("s0"), **(options if level == "task" else {})),
                          **(options if level == "agent" else {})),
                    agent("a1", task("t0", echo("s0"))))
    run = running_run(project, the_plan, **(options if level == "run" else {}))
    fail(begin(run.pk, "a0/t0/s0"))
    run = fresh(run.pk)
    assert (run.status, run.attempt_number, run.last_error_code) == (Run.Status.FAILED, 1, "drill_fatal")
    assert (node(run.pk, "a0/t0").retry_count, node(run.pk, "a0").retry_count) == (0, 0)
    assert RunAttempt.objects.filter(run=run).count() == 1
    assert_settled(run)
    assert_invariants()


def test_a_task_retry_discards_the_results_of_its_other_steps_in_flight(project, clock):
    run = running_run(project, plan(agent("a0", task("t0", echo("s0"), drill("s1", mode="retryable"),
                                                     parallelism_mode="parallel", failure_mode="retry"))),
                      credit_limit=20)
    in_flight = begin(run.pk, "a0/t0/s0")
    exhaust(run.pk, "a0/t0/s1", clock)
    charges = LedgerEntry.objects.filter(run=run, kind="charge").count()

    assert succeed(in_flight).decision == "discarded"

    assert LedgerEntry.objects.filter(run=run, kind="charge").count() == charges
    assert status(run.pk, "a0/t0/s0") == PENDING
    assert runnable(run.pk) == ["a0/t0/s0", "a0/t0/s1"]
    run_step(run.pk, "a0/t0/s0")
    run_step(run.pk, "a0/t0/s1")
    assert fresh(run.pk).status == Run.Status.COMPLETED
    assert_settled(fresh(run.pk))
    assert_invariants()


# --- agent level ----------------------------------------------------------------------------

def test_agent_continue_goes_on_with_its_other_tasks(project):
    run = running_run(project, plan(agent("a0", task("t0", drill("s0")), task("t1", echo("s0")),
                                          failure_mode="continue")))
    fail(begin(run.pk, "a0/t0/s0"))
    assert (status(run.pk, "a0/t0"), status(run.pk, "a0")) == (FAILED, RUNNING)
    assert runnable(run.pk) == ["a0/t1/s0"]
    run_step(run.pk, "a0/t1/s0")
    assert (status(run.pk, "a0"), fresh(run.pk).status) == (COMPLETED, Run.Status.COMPLETED)
    assert_settled(fresh(run.pk))
    assert_invariants()


def test_agent_continue_with_every_task_failed_is_skipped_and_the_run_goes_on(project):
    run = running_run(project, plan(agent("a0", task("t0", drill("s0")), failure_mode="continue"),
                                    agent("a1", task("t0", echo("s0")))))
    fail(begin(run.pk, "a0/t0/s0"))
    assert (status(run.pk, "a0/t0"), status(run.pk, "a0")) == (FAILED, SKIPPED)
    assert fresh(run.pk).status == Run.Status.RUNNING
    run_step(run.pk, "a1/t0/s0")
    assert fresh(run.pk).status == Run.Status.COMPLETED
    assert_settled(fresh(run.pk))
    assert_invariants()


def test_agent_retry_restarts_all_its_tasks_up_to_three_times_then_fails(project, clock):
    run = running_run(project, plan(agent("a0", task("t0", echo("s0")), task("t1", drill("s0", mode="retryable")),
                                          failure_mode="retry"),
                                    agent("a1", task("t0", echo("s0")))), credit_limit=100)
    for retry in range(1, 4):
        run_step(run.pk, "a0/t0/s0")
        exhaust(run.pk, "a0/t1/s0", clock)
        a0 = node(run.pk, "a0")
        assert (a0.status, a0.retry_count) == (PENDING, retry)
        assert (status(run.pk, "a0/t0"), status(run.pk, "a0/t1")) == (PENDING, PENDING)
        assert runnable(run.pk, agent="a0") == ["a0/t0/s0"]  # from the first task again
    run_step(run.pk, "a0/t0/s0")
    exhaust(run.pk, "a0/t1/s0", clock)

    run = fresh(run.pk)
    assert (status(run.pk, "a0"), run.status, run.last_error_code) == (
        FAILED, Run.Status.FAILED, "drill_retryable")
    assert node(run.pk, "a0").retry_count == 3
    assert (node(run.pk, "a0/t0/s0").attempts, node(run.pk, "a0/t1/s0").attempts) == (4, 12)
    assert_settled(run)
    assert_no_live_nodes(run.pk)
    assert_invariants()


# --- run level ------------------------------------------------------------------------------

def test_run_continue_completes_when_another_agent_completed(project):
    run = running_run(project, plan(agent("a0", task("t0", drill("s0"))), agent("a1", task("t0", echo("s0")))),
                      failure_mode="continue")
    fail(begin(run.pk, "a0/t0/s0"))
    assert (status(run.pk, "a0"), fresh(run.pk).status) == (FAILED, Run.Status.RUNNING)
    assert runnable(run.pk) == ["a1/t0/s0"]
    run_step(run.pk, "a1/t0/s0")
    run = fresh(run.pk)
    assert run.status == Run.Status.COMPLETED
    assert (run.credits_charged, run.credits_refunded) == (2, 4)
    assert_settled(run)
    assert_invariants()


def test_run_continue_fails_when_no_agent_completed(project):
    run = running_run(project, plan(agent("a0", task("t0", drill("s0"))), agent("a1", task("t0", drill("s0")))),
                      failure_mode="continue")
    fail(begin(run.pk, "a0/t0/s0"))
    fail(begin(run.pk, "a1/t0/s0"))
    run = fresh(run.pk)
    assert (run.status, run.last_error_code) == (Run.Status.FAILED, "no_agent_completed")
    assert_settled(run)
    assert_invariants()


def test_run_retry_creates_attempt_two_with_a_new_reservation(project, clock):
    run = running_run(project, plan(agent("a0", task("t0", drill("s0", mode="retryable"))),
                                    agent("a1", task("t0", echo("s0")))), failure_mode="retry")
    assert run.credit_limit == 6
    run_step(run.pk, "a1/t0/s0")
    exhaust(run.pk, "a0/t0/s0", clock)

    run = fresh(run.pk)
    assert (run.status, run.attempt_number) == (Run.Status.RETRYING, 2)
    assert run_events(run.pk)[-2:] == ["run_failed", "run_retrying"]
    first, second = RunAttempt.objects.filter(run=run).order_by("number")
    assert (first.outcome, first.error_code, first.credits_reserved, first.credits_charged,
            first.credits_refunded) == ("failed", "drill_retryable", 6, 4, 2)
    assert (second.number, second.outcome, second.credits_reserved) == (2, "", 6)
    assert list(LedgerEntry.objects.filter(run=run, kind="reserve").values_list("attempt_number", "amount")) == [
        (1, 6), (2, 6)]
    assert account_balance(organization_id=project.organization_id)["reserved"] == 6
    assert runnable(run.pk) == []
    assert_invariants()

    services.run_requeue(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    assert runnable(run.pk) == ["a0/t0/s0", "a1/t0/s0"]
    run_step(run.pk, "a0/t0/s0")
    run_step(run.pk, "a1/t0/s0")

    run = fresh(run.pk)
    assert run.status == Run.Status.COMPLETED
    assert (status(run.pk, "a0", attempt=1), status(run.pk, "a1", attempt=1)) == (FAILED, COMPLETED)  # kept
    assert (status(run.pk, "a0", attempt=2), status(run.pk, "a1", attempt=2)) == (COMPLETED, COMPLETED)
    assert (run.credits_reserved, run.credits_charged, run.credits_refunded) == (12, 6, 6)
    assert_settled(run)
    assert_invariants()


def test_run_retry_stops_after_three_automatic_retries(project, clock):
    run = running_run(project, plan(agent("a0", task("t0", drill("s0", mode="retryable", times=99))),
                                    agent("a1", task("t0", echo("s0")))), failure_mode="retry", max_attempts=10)
    for attempt in range(1, 5):
        if attempt > 1:
            assert fresh(run.pk).status == Run.Status.RETRYING
            services.run_requeue(run_id=run.pk)
            services.run_mark_running(run_id=run.pk)
        assert fresh(run.pk).attempt_number == attempt
        exhaust(run.pk, "a0/t0/s0", clock)

    run = fresh(run.pk)
    assert (run.status, run.attempt_number) == (Run.Status.FAILED, 4)  # 1 run + 3 retries
    assert RunAttempt.objects.filter(run=run).count() == 4
    assert_settled(run)
    assert_invariants()
    # An operator may still retry by hand while attempts are left.
    assert services.run_retry(run_id=run.pk).attempt_number == 5


def test_run_retry_without_credits_for_the_new_reservation_stays_failed(org_factory, clock):
    organization, project, _ = org_factory(credits=6)
    run = running_run(project, plan(agent("a0", task("t0", drill("s0", mode="retryable"))),
                                    agent("a1", task("t0", echo("s0")))), failure_mode="retry")
    exhaust(run.pk, "a0/t0/s0", clock)  # costs 3: 3 credits left, 6 needed

    run = fresh(run.pk)
    assert (run.status, run.attempt_number) == (Run.Status.FAILED, 1)
    assert RunAttempt.objects.filter(run=run).count() == 1
    assert run_events(run.pk)[-2:] == ["run_failed", "run_retry_refused"]
    assert LedgerEntry.objects.filter(run=run, kind="reserve").count() == 1
    assert_settled(run)
    assert_invariants()


# --- step retries and backoff ---------------------------------------------------------------

class FixedRandom:
    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.mark.parametrize("tries_done", [1, 2, 3, 5, 8, 9, 10, 12, 20, 60])
def test_step_backoff_is_exponential_with_jitter_and_capped(tries_done):
    base = min(100 * 2 ** (tries_done - 1), 30_000)
    low, high = base * 0.9 - 1e-6, base * 1.1 + 1e-6
    assert services.step_backoff_ms(tries_done, rng=FixedRandom(0.5)) == base
    for value in (0.0, 0.000001, 0.25, 0.75, 0.999999):
        assert low <= services.step_backoff_ms(tries_done, rng=FixedRandom(value)) <= high, value
    for _ in range(50):
        assert low <= services.step_backoff_ms(tries_done) <= high


def test_step_backoff_reaches_its_cap_at_thirty_seconds():
    assert services.step_backoff_ms(9, rng=FixedRandom(0.5)) == 25_600
    assert services.step_backoff_ms(10, rng=FixedRandom(0.5)) == 30_000
    assert services.step_backoff_ms(1000, rng=FixedRandom(0.5)) == 30_000


@pytest.mark.parametrize("value", [0.0, 0.3, 0.5, 0.999999])
def test_step_retries_and_job_retries_wait_by_the_same_rule(value):
    for retry in range(1, 14):
        assert services.step_backoff_ms(retry, rng=FixedRandom(value)) == \
            RetryPolicy().delay_ms(retry, rng=FixedRandom(value)), retry


def test_a_retryable_step_failure_waits_out_its_backoff(project, clock):
    run = running_run(project, plan(agent("a0", task("t0", drill("s0", mode="retryable", times=2), echo("s1")))))
    expected_base = 100
    for try_number in (1, 2):
        outcome = fail(begin(run.pk, "a0/t0/s0"), retryable=True, code="drill_retryable")
        assert outcome.decision == "retry"
        assert expected_base * 0.9 <= outcome.delay_ms <= expected_base * 1.1
        step = node(run.pk, "a0/t0/s0")
        assert (step.status, step.tries_this_round, step.last_error_code) == (PENDING, try_number, "drill_retryable")
        assert step.not_before == clock.now + timedelta(milliseconds=outcome.delay_ms)
        # Not runnable until not_before; the next sequential step waits too.
        assert runnable(run.pk, now=clock.now) == []
        assert runnable(run.pk, now=step.not_before - timedelta(milliseconds=1)) == []
        assert runnable(run.pk, now=step.not_before) == ["a0/t0/s0"]
        with pytest.raises(InvalidTransition, match="backoff"):
            begin(run.pk, "a0/t0/s0")
        clock.advance(milliseconds=outcome.delay_ms)
        expected_base *= 2
    run_step(run.pk, "a0/t0/s0")
    run_step(run.pk, "a0/t0/s1")

    run = fresh(run.pk)
    assert run.status == Run.Status.COMPLETED
    step = node(run.pk, "a0/t0/s0")
    assert (step.attempts, step.not_before, step.credits_charged) == (3, None, 3)
    assert list(StepAttempt.objects.filter(step=step).values_list("number", "outcome")) == [
        (1, "failed"), (2, "failed"), (3, "succeeded")]
    assert (run.credits_charged, run.credits_refunded) == (4, 2)
    assert_settled(run)
    assert_invariants()


def test_a_step_fails_for_good_after_three_retryable_failures(project, clock):
    # A second, healthy agent: one failed agent of two does not call for a re-plan (seed 001 §6.4).
    run = running_run(project, plan(agent("a0", task("t0", drill("s0", mode="retryable", times=5))),
                                    agent("a1", task("t0", echo("s0")))))
    decisions = []
    for _ in range(3):
        outcome = fail(begin(run.pk, "a0/t0/s0"), retryable=True, code="drill_retryable")
        decisions.append(outcome.decision)
        clock.advance(seconds=1)
    assert decisions == ["retry", "retry", "failed"]
    run = fresh(run.pk)
    assert (status(run.pk, "a0/t0/s0"), run.status, run.last_error_code) == (
        FAILED, Run.Status.FAILED, "drill_retryable")
    step = node(run.pk, "a0/t0/s0")
    assert (step.attempts, step.tries_this_round, step.not_before) == (3, 3, None)
    # The default credit limit covers three tries of every step: 3 of 6 were used.
    assert (run.credit_limit, run.credits_charged, run.credits_refunded) == (6, 3, 3)
    assert_settled(run)
    assert_no_live_nodes(run.pk)
    assert_invariants()


def test_a_non_retryable_step_failure_is_not_retried(project):
    run = running_run(project, plan(agent("a0", task("t0", drill("s0")))))
    outcome = fail(begin(run.pk, "a0/t0/s0"), retryable=False)
    assert (outcome.decision, outcome.delay_ms) == ("failed", 0)
    step = node(run.pk, "a0/t0/s0")
    assert (step.status, step.attempts, step.not_before) == (FAILED, 1, None)
    assert fresh(run.pk).status == Run.Status.FAILED
    assert_invariants()


# --- ordering: sequential, dag, parallel, max_agents ----------------------------------------

def test_sequential_tasks_and_steps_run_one_after_another(project):
    run = running_run(project, plan(agent("a0", task("t0", echo("s0"), echo("s1")), task("t1", echo("s0")))))
    assert runnable(run.pk) == ["a0/t0/s0"]
    attempt = begin(run.pk, "a0/t0/s0")
    assert runnable(run.pk) == []  # the step is running; nothing else in this agent may start
    with pytest.raises(InvalidTransition):
        begin(run.pk, "a0/t0/s1")
    with pytest.raises(InvalidTransition):
        begin(run.pk, "a0/t1/s0")
    succeed(attempt)
    assert runnable(run.pk) == ["a0/t0/s1"]
    run_step(run.pk, "a0/t0/s1")
    assert runnable(run.pk) == ["a0/t1/s0"]
    run_step(run.pk, "a0/t1/s0")
    assert fresh(run.pk).status == Run.Status.COMPLETED
    assert_invariants()


def test_dag_runs_a_task_only_after_its_dependencies_completed(project):
    run = running_run(project, plan(agent(
        "a0",
        task("fetch", echo("s0")),
        task("parse", echo("s0"), depends_on=["fetch"]),
        task("index", echo("s0"), depends_on=["fetch"]),
        task("report", echo("s0"), depends_on=["parse", "index"]),
        parallelism_mode="dag",
    )))
    assert runnable(run.pk) == ["a0/fetch/s0"]
    before = Event.objects.count()
    with pytest.raises(InvalidTransition, match="dependencies"):
        begin(run.pk, "a0/report/s0")
    assert Event.objects.count() == before and status(run.pk, "a0/report/s0") == PENDING

    run_step(run.pk, "a0/fetch/s0")
    assert runnable(run.pk) == ["a0/index/s0", "a0/parse/s0"]  # independent: both at once
    run_step(run.pk, "a0/parse/s0")
    assert runnable(run.pk) == ["a0/index/s0"]  # report still waits for index
    run_step(run.pk, "a0/index/s0")
    assert runnable(run.pk) == ["a0/report/s0"]
    run_step(run.pk, "a0/report/s0")

    started = {t.name: t.started_at for t in Task.objects.filter(run=run)}
    finished = {t.name: t.finished_at for t in Task.objects.filter(run=run)}
    assert started["parse"] >= finished["fetch"] and started["index"] >= finished["fetch"]
    assert started["report"] >= max(finished["parse"], finished["index"])
    assert fresh(run.pk).status == Run.Status.COMPLETED
    assert_invariants()


def test_dag_dependents_of_a_failed_task_are_skipped_in_continue_mode(project):
    run = running_run(project, plan(agent(
        "a0",
        task("fetch", drill("s0")),
        task("parse", echo("s0"), depends_on=["fetch"]),
        task("report", echo("s0"), depends_on=["parse"]),
        task("other", echo("s0")),
        parallelism_mode="dag", failure_mode="continue",
    )))
    assert runnable(run.pk) == ["a0/fetch/s0", "a0/other/s0"]
    fail(begin(run.pk, "a0/fetch/s0"))

    assert [status(run.pk, f"a0/{t}") for t in ("fetch", "parse", "report")] == [FAILED, SKIPPED, SKIPPED]
    assert [status(run.pk, f"a0/{t}/s0") for t in ("parse", "report")] == [SKIPPED, SKIPPED]
    assert runnable(run.pk) == ["a0/other/s0"]
    run_step(run.pk, "a0/other/s0")
    run = fresh(run.pk)
    assert (status(run.pk, "a0"), run.status) == (COMPLETED, Run.Status.COMPLETED)
    assert_settled(run)
    assert_invariants()


def test_parallel_steps_run_at_most_three_at_a_time(project):
    run = running_run(project, plan(agent("a0", task("t0", *[echo(f"s{i}") for i in range(5)],
                                                     parallelism_mode="parallel"))))
    assert runnable(run.pk) == ["a0/t0/s0", "a0/t0/s1", "a0/t0/s2"]
    attempts = [begin(run.pk, f"a0/t0/s{i}") for i in range(3)]
    assert runnable(run.pk) == []
    with pytest.raises(InvalidTransition):
        begin(run.pk, "a0/t0/s3")
    succeed(attempts[1])
    assert runnable(run.pk) == ["a0/t0/s3"]
    attempts.append(begin(run.pk, "a0/t0/s3"))
    for attempt in (attempts[0], attempts[2], attempts[3]):
        succeed(attempt)
    assert runnable(run.pk) == ["a0/t0/s4"]
    run_step(run.pk, "a0/t0/s4")
    assert fresh(run.pk).status == Run.Status.COMPLETED
    assert_invariants()


def test_parallel_tasks_run_at_most_five_at_a_time(project):
    run = running_run(project, plan(agent("a0", *[task(f"t{i}", echo("s0")) for i in range(7)],
                                          parallelism_mode="parallel")))
    assert runnable(run.pk) == [f"a0/t{i}/s0" for i in range(5)]
    attempts = [begin(run.pk, f"a0/t{i}/s0") for i in range(5)]
    assert runnable(run.pk) == []
    succeed(attempts[0])
    assert runnable(run.pk) == ["a0/t5/s0"]
    for attempt in attempts[1:]:
        succeed(attempt)
    run_step(run.pk, "a0/t5/s0")
    run_step(run.pk, "a0/t6/s0")
    assert fresh(run.pk).status == Run.Status.COMPLETED
    assert_invariants()


def test_agents_run_in_parallel_up_to_max_agents(project):
    run = running_run(project, plan(*[agent(f"a{i}", task("t0", echo("s0"), echo("s1"))) for i in range(3)],
                                    max_agents=2))
    assert run.max_agents == 2
    assert runnable(run.pk) == ["a0/t0/s0", "a1/t0/s0"]
    first = begin(run.pk, "a0/t0/s0")
    begin_a1 = begin(run.pk, "a1/t0/s0")
    with pytest.raises(InvalidTransition):
        begin(run.pk, "a2/t0/s0")
    succeed(first)
    succeed(begin_a1)
    assert runnable(run.pk) == ["a0/t0/s1", "a1/t0/s1"]  # a0 and a1 still hold both slots
    run_step(run.pk, "a0/t0/s1")
    assert status(run.pk, "a0") == COMPLETED
    assert runnable(run.pk) == ["a1/t0/s1", "a2/t0/s0"]  # a slot freed up
    for path in ("a1/t0/s1", "a2/t0/s0", "a2/t0/s1"):
        run_step(run.pk, path)
    assert fresh(run.pk).status == Run.Status.COMPLETED
    assert_invariants()


# --- late and repeated results --------------------------------------------------------------

def test_a_late_result_after_cancel_is_discarded_and_not_charged(project):
    run = running_run(project, plan(agent("a0", task("t0", echo("s0"), echo("s1"), echo("s2"))),
                                    agent("a1", task("t0", echo("s0")))))
    run_step(run.pk, "a0/t0/s0")
    run_step(run.pk, "a1/t0/s0")
    in_flight = begin(run.pk, "a0/t0/s1")

    services.run_cancel(run_id=run.pk, reason="user asked")

    run = fresh(run.pk)
    assert run.status == Run.Status.CANCELLED
    # 4 steps × 3 reserved, 2 charged, everything else released.
    assert (run.credits_reserved, run.credits_charged, run.credits_refunded) == (12, 2, 10)
    assert_settled(run)
    assert account_balance(organization_id=project.organization_id) == {
        "organization": project.organization_id, "balance": 998, "reserved": 0, "available": 998}
    assert (status(run.pk, "a0"), status(run.pk, "a1")) == (CANCELLED, COMPLETED)
    assert_no_live_nodes(run.pk)
    ledger_before = LedgerEntry.objects.count()

    assert succeed(in_flight).decision == "discarded"

    assert LedgerEntry.objects.count() == ledger_before
    assert StepAttempt.objects.get(pk=in_flight.pk).outcome == StepAttempt.Outcome.DISCARDED
    assert node(run.pk, "a0/t0/s1").credits_charged == 0
    assert fresh(run.pk).credits_charged == 2
    assert runnable(run.pk) == []
    assert_invariants()


def test_a_late_failure_after_the_run_failed_is_discarded_and_not_charged(project):
    run = running_run(project, plan(agent("a0", task("t0", echo("s0"))), agent("a1", task("t0", echo("s0")))))
    in_flight = begin(run.pk, "a1/t0/s0")
    services.run_fail(run_id=run.pk, code="heartbeat_timeout", message="no heartbeat for 60 s")
    ledger_before = LedgerEntry.objects.count()

    outcome = fail(in_flight, retryable=True)

    assert outcome.decision == "discarded"
    assert LedgerEntry.objects.count() == ledger_before
    run = fresh(run.pk)
    assert (run.status, run.last_error_code, run.credits_charged) == (Run.Status.FAILED, "heartbeat_timeout", 0)
    assert_settled(run)
    assert_invariants()


def test_a_repeated_result_is_recorded_once(project):
    run = running_run(project, plan(agent("a0", task("t0", echo("s0"), echo("s1")))))
    attempt = begin(run.pk, "a0/t0/s0")
    assert succeed(attempt).decision == "completed"
    charges = LedgerEntry.objects.filter(run=run, kind="charge").count()
    assert succeed(attempt).decision == "replayed"
    assert fail(attempt).decision == "replayed"
    assert LedgerEntry.objects.filter(run=run, kind="charge").count() == charges == 1
    assert status(run.pk, "a0/t0/s0") == COMPLETED
    assert fresh(run.pk).status == Run.Status.RUNNING
    assert_invariants()


def test_a_charge_past_the_credit_limit_fails_the_step_without_retry(project, clock):
    # The limit covers one try of each step (the least run_create accepts); s0's retry uses it up.
    run = running_run(project, plan(agent("a0", task("t0", drill("s0", mode="retryable"), echo("s1"),
                                                     failure_mode="fail-fast"))), credit_limit=2)
    retry = fail(begin(run.pk, "a0/t0/s0"), retryable=True, code="drill_retryable")
    assert retry.decision == "retry"
    clock.advance(milliseconds=retry.delay_ms)
    run_step(run.pk, "a0/t0/s0")
    outcome = succeed(begin(run.pk, "a0/t0/s1"))

    assert (outcome.decision, outcome.error_code) == ("failed", "credit_limit_exceeded")
    step = node(run.pk, "a0/t0/s1")
    assert (step.status, step.attempts, step.credits_charged, step.last_error_code) == (
        FAILED, 1, 0, "credit_limit_exceeded")
    attempt = StepAttempt.objects.get(step=step)
    assert (attempt.outcome, attempt.retryable, attempt.cost) == ("failed", False, 0)
    run = fresh(run.pk)
    assert (run.status, run.last_error_code) == (Run.Status.FAILED, "credit_limit_exceeded")
    assert (run.credits_reserved, run.credits_charged, run.credits_refunded) == (2, 2, 0)
    assert_settled(run)
    assert_invariants()


def test_a_retryable_failure_past_the_credit_limit_is_not_retried(project, clock):
    run = running_run(project, plan(agent("a0", task("t0", echo("s0"), drill("s1", mode="retryable")))),
                      credit_limit=2)
    run_step(run.pk, "a0/t0/s0")
    first = fail(begin(run.pk, "a0/t0/s1"), retryable=True, code="drill_retryable")
    assert first.decision == "retry"  # its cost fits: one try of each step
    clock.advance(milliseconds=first.delay_ms)
    outcome = fail(begin(run.pk, "a0/t0/s1"), retryable=True, code="drill_retryable")
    assert (outcome.decision, outcome.error_code) == ("failed", "credit_limit_exceeded")
    assert node(run.pk, "a0/t0/s1").not_before is None
    assert fresh(run.pk).status == Run.Status.FAILED
    assert_settled(fresh(run.pk))
    assert_invariants()


# --- pause, resume, cancel mid-run ----------------------------------------------------------

def test_pause_stops_new_work_and_resume_continues_to_completion(project):
    run = running_run(project, plan(agent("a0", task("t0", echo("s0"), echo("s1")))))
    in_flight = begin(run.pk, "a0/t0/s0")

    services.run_pause(run_id=run.pk)

    assert runnable(run.pk) == []
    assert [status(run.pk, p) for p in ("a0", "a0/t0", "a0/t0/s0", "a0/t0/s1")] == [PAUSED] * 4
    with pytest.raises(InvalidTransition, match="paused"):
        begin(run.pk, "a0/t0/s1")
    # The result of the step that was already running still counts.
    assert succeed(in_flight).decision == "completed"
    assert fresh(run.pk).status == Run.Status.PAUSED
    assert_invariants()

    services.run_resume(run_id=run.pk)
    assert fresh(run.pk).status == Run.Status.RESUMING
    assert runnable(run.pk) == []
    assert [status(run.pk, p) for p in ("a0", "a0/t0", "a0/t0/s1")] == [PENDING] * 3

    services.run_mark_running(run_id=run.pk)
    assert runnable(run.pk) == ["a0/t0/s1"]
    run_step(run.pk, "a0/t0/s1")
    run = fresh(run.pk)
    assert run.status == Run.Status.COMPLETED
    assert run_events(run.pk) == ["run_created", "run_pending", "run_running", "run_paused", "run_resuming",
                                  "run_running", "run_completed"]
    assert (run.credits_charged, run.credits_refunded) == (2, 4)
    assert_settled(run)
    assert_invariants()


def test_a_step_interrupted_by_pause_runs_again_after_resume(project):
    run = running_run(project, plan(agent("a0", task("t0", echo("s0")))))
    interrupted = begin(run.pk, "a0/t0/s0")
    services.run_pause(run_id=run.pk)
    services.run_resume(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    assert runnable(run.pk) == ["a0/t0/s0"]
    rerun = begin(run.pk, "a0/t0/s0")

    assert succeed(interrupted).decision == "discarded"
    assert succeed(rerun).decision == "completed"

    run = fresh(run.pk)
    assert run.status == Run.Status.COMPLETED
    assert run.credits_charged == 1
    assert_settled(run)
    assert_invariants()


def test_work_finished_while_paused_completes_the_run_when_it_resumes(project):
    run = running_run(project, plan(agent("a0", task("t0", echo("s0")))))
    in_flight = begin(run.pk, "a0/t0/s0")
    services.run_pause(run_id=run.pk)
    succeed(in_flight)
    assert (status(run.pk, "a0"), fresh(run.pk).status) == (COMPLETED, Run.Status.PAUSED)
    assert_invariants()

    services.run_resume(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)

    run = fresh(run.pk)
    assert run.status == Run.Status.COMPLETED
    assert_settled(run)
    assert_invariants()


@pytest.mark.parametrize(("failure_mode", "retryable"), [
    ("fail-fast", True), ("fail-fast", False), ("retry", True), ("retry", False), ("continue", True)])
def test_an_agent_failure_reported_while_paused_takes_effect_when_the_run_resumes(project, clock, failure_mode,
                                                                                   retryable):
    run = running_run(project, plan(agent("a0", task("t0", drill("s0", mode="retryable" if retryable else "fatal"))),
                                    agent("a1", task("t0", echo("s0"), echo("s1")))), failure_mode=failure_mode)
    begin(run.pk, "a1/t0/s0")
    if retryable:  # two tries fail while running; the last one is reported during the pause
        for _ in range(2):
            clock.advance(milliseconds=fail(begin(run.pk, "a0/t0/s0"), retryable=True,
                                            code="drill_retryable").delay_ms)
    failing = begin(run.pk, "a0/t0/s0")
    services.run_pause(run_id=run.pk)
    code = "drill_retryable" if retryable else "drill_fatal"
    fail(failing, retryable=retryable, code=code, message="crashed during the pause")
    # A paused run cannot fail; the failure waits for the run to resume.
    assert (status(run.pk, "a0"), fresh(run.pk).status) == (FAILED, Run.Status.PAUSED)
    assert_invariants()

    services.run_resume(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)

    run = fresh(run.pk)
    if failure_mode == "continue":  # the other agent carries on and the run completes
        assert run.status == Run.Status.RUNNING
        assert runnable(run.pk) == ["a1/t0/s0"]
        run_step(run.pk, "a1/t0/s0")
        run_step(run.pk, "a1/t0/s1")
        run = fresh(run.pk)
        assert run.status == Run.Status.COMPLETED
        assert_settled(run)
    else:
        assert run.last_error_code == code
        assert run.last_error == "agent a0: task t0: step s0: crashed during the pause"
        first = RunAttempt.objects.get(run=run, number=1)
        assert (first.outcome, first.error_code) == ("failed", code)
        assert first.credits_charged + first.credits_refunded == first.credits_reserved
        assert not StepAttempt.objects.filter(run=run, outcome=StepAttempt.Outcome.RUNNING).exists()
        assert runnable(run.pk) == []
        if failure_mode == "retry" and retryable:
            assert (run.status, run.attempt_number) == (Run.Status.RETRYING, 2)
            assert run_events(run.pk)[-3:] == ["run_running", "run_failed", "run_retrying"]
        else:
            assert (run.status, run.attempt_number) == (Run.Status.FAILED, 1)
            assert run_events(run.pk)[-3:] == ["run_resuming", "run_running", "run_failed"]
            assert_no_live_nodes(run.pk)
            assert_settled(run)
    assert_invariants()


def test_a_failure_answered_by_a_replan_does_not_fail_the_run_on_a_later_resume(project, clock):
    run = running_run(project, plan(agent("a0", task("t0", drill("s0", mode="retryable")))))
    exhaust(run.pk, "a0/t0/s0", clock)
    run = fresh(run.pk)
    # Every agent failed on transient errors: the planner re-decomposed the work instead.
    assert (status(run.pk, "a0"), run.status, run.replan_count) == (FAILED, Run.Status.RUNNING, 1)
    waiting = runnable(run.pk)
    assert waiting

    services.run_pause(run_id=run.pk)
    services.run_resume(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)

    run = fresh(run.pk)
    assert (run.status, run.last_error_code) == (Run.Status.RUNNING, "")
    assert runnable(run.pk) == waiting
    assert_invariants()


def test_cancel_while_paused_refunds_everything_not_charged(project, django_user_model):
    operator = django_user_model.objects.create_user(username="canceller", is_staff=True)
    run = running_run(project, plan(agent("a0", task("t0", echo("s0"), echo("s1"), echo("s2")))))
    run_step(run.pk, "a0/t0/s0")
    in_flight = begin(run.pk, "a0/t0/s1")
    services.run_pause(run_id=run.pk)

    services.run_cancel(run_id=run.pk, actor=operator, reason="no longer needed")

    run = fresh(run.pk)
    assert run.status == Run.Status.CANCELLED
    assert run.cancelled_at is not None and run.duration_ms is not None
    assert (run.credits_reserved, run.credits_charged, run.credits_refunded) == (9, 1, 8)
    refunds = list(LedgerEntry.objects.filter(run=run, kind="refund").values_list("source", "amount"))
    assert refunds == [("reservation", 8)]
    assert_settled(run)
    assert_no_live_nodes(run.pk)
    assert AuditRecord.objects.get(run_id=run.pk, action="run_cancel").actor_id == operator.pk
    assert succeed(in_flight).decision == "discarded"
    assert fresh(run.pk).credits_charged == 1
    assert account_balance(organization_id=project.organization_id)["balance"] == 999
    assert_invariants()
