"""Runs executed by the job queue in this process: plans, billing, retries, propagation, control."""

from __future__ import annotations

import pytest

from billing.models import LedgerEntry
from billing.selectors import account_balance
from core.models import Event
from runs import services
from runs.invariants import invariants_check
from runs.models import Agent, EscalationTicket, NodeStatus, Run, Step, StepAttempt, Task
from tests.conftest import make_plan
from tests.drive import drain_jobs

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def no_wake_messages(monkeypatch):
    monkeypatch.setattr("jobs.wake._send", lambda count: None)


def start(project, plan, **options):
    run = services.run_create(project=project, name="e2e", plan=plan, **options)
    services.run_start(run_id=run.pk)
    return run


def run_has_jobs(run) -> bool:
    from jobs.models import ACTIVE_JOB_STATES, Job

    return Job.objects.filter(run_id=run.pk, state__in=list(ACTIVE_JOB_STATES)).exists()


def finish(run, timeout=20.0):
    settled = {Run.Status.COMPLETED, Run.Status.FAILED, Run.Status.CANCELLED, Run.Status.PAUSED}
    drain_jobs(until=lambda: Run.objects.get(pk=run.pk).status in settled and not run_has_jobs(run), timeout=timeout)
    run.refresh_from_db()
    assert invariants_check() == []
    return run


def test_a_backoff_ending_while_a_tick_looks_is_still_waited_for(project, monkeypatch):
    """The run's job finds no step to start; the step's backoff ends before it looks for what waits.
    It must still tick the run again when that backoff ends (else the step waits for ever)."""
    from datetime import timedelta

    from django.utils import timezone

    from jobs.models import Job
    from runs import execution

    run = start(project, make_plan(steps=1))
    services.run_mark_running(run_id=run.pk)  # its nodes written; the job run_start queued still waits
    ends = timezone.now() + timedelta(seconds=30)
    Step.objects.filter(run=run).update(not_before=ends)  # a retry's backoff, as a failed try leaves it
    clock = {"now": ends - timedelta(milliseconds=1)}
    monkeypatch.setattr(timezone, "now", lambda: clock["now"])
    found = execution.services.runnable_steps

    def runnable_then_later(run, **kwargs):
        steps = found(run, **kwargs)
        clock["now"] = ends + timedelta(milliseconds=1)  # the backoff ends just after the runnable steps are found
        return steps

    monkeypatch.setattr(execution.services, "runnable_steps", runnable_then_later)
    drain_jobs(until=lambda: Job.objects.filter(run_id=run.pk, state="completed").exists(), timeout=10)
    woken = Job.objects.filter(run_id=run.pk, type="run_tick", state="queued").values_list("not_before", flat=True)
    assert list(woken) == [ends]


def test_a_two_by_three_by_two_plan_completes_and_settles(project):
    run = finish(start(project, make_plan(agents=2, tasks=3, steps=2)))
    assert run.status == Run.Status.COMPLETED
    assert (run.credits_reserved, run.credits_charged, run.credits_refunded) == (36, 12, 24)
    assert Step.objects.filter(run=run, status=NodeStatus.COMPLETED).count() == 12
    assert StepAttempt.objects.filter(run=run).count() == 12
    assert account_balance(organization_id=project.organization_id)["balance"] == 1000 - 12
    assert Agent.objects.filter(run=run, status=NodeStatus.COMPLETED).count() == 2


def test_a_fatal_step_fails_the_run_and_refunds(project):
    plan = make_plan(tool="fail", args={"mode": "fatal"})
    run = finish(start(project, plan))
    assert (run.status, run.last_error_code) == (Run.Status.FAILED, "drill_fatal")
    assert run.credits_charged == 1 and run.credits_charged + run.credits_refunded == run.credits_reserved
    assert StepAttempt.objects.filter(run=run).count() == 1  # fatal: never retried


def test_a_retryable_step_that_fails_twice_then_succeeds(project):
    plan = make_plan(tool="fail", args={"mode": "retryable", "times": 2})
    run = finish(start(project, plan))
    assert run.status == Run.Status.COMPLETED
    attempts = list(StepAttempt.objects.filter(run=run).order_by("number").values_list("outcome", "cost"))
    assert attempts == [("failed", 1), ("failed", 1), ("succeeded", 1)]
    assert run.credits_charged == 3
    keys = set(StepAttempt.objects.filter(run=run).values_list("idempotency_key", flat=True))
    assert len(keys) == 3


def test_a_dag_agent_runs_tasks_in_dependency_order(project):
    plan = {"agents": [{"name": "dag", "parallelism_mode": "dag", "tasks": [
        {"name": "report", "depends_on": ["fetch", "parse"], "steps": [{"name": "r", "tool": "echo",
                                                                          "args": {"text": "r"}}]},
        {"name": "parse", "depends_on": ["fetch"], "steps": [{"name": "p", "tool": "echo", "args": {"text": "p"}}]},
        {"name": "fetch", "steps": [{"name": "f", "tool": "echo", "args": {"text": "f"}}]},
    ]}]}
    run = finish(start(project, plan))
    assert run.status == Run.Status.COMPLETED
    started = {t.name: t.started_at for t in Task.objects.filter(run=run)}
    finished = {t.name: t.finished_at for t in Task.objects.filter(run=run)}
    assert finished["fetch"] <= started["parse"] and finished["parse"] <= started["report"]


def test_continue_mode_skips_the_failed_task_and_goes_on(project):
    plan = {"agents": [{"name": "a", "failure_mode": "continue", "tasks": [
        {"name": "broken", "steps": [{"name": "x", "tool": "fail", "args": {"mode": "fatal"}}]},
        {"name": "fine", "steps": [{"name": "y", "tool": "echo", "args": {"text": "ok"}}]},
    ]}]}
    run = finish(start(project, plan))
    assert run.status == Run.Status.COMPLETED
    tasks = dict(Task.objects.filter(run=run).values_list("name", "status"))
    assert tasks == {"broken": NodeStatus.FAILED, "fine": NodeStatus.COMPLETED}


def test_pause_resume_and_cancel_while_running(project):
    plan = make_plan(steps=3, tool="sleep", args={"seconds": 0.05})
    run = start(project, plan)
    drain_jobs(until=lambda: StepAttempt.objects.filter(run=run, outcome="succeeded").count() >= 1)
    services.run_pause(run_id=run.pk, reason="look")
    drain_jobs(timeout=5)
    run.refresh_from_db()
    assert run.status == Run.Status.PAUSED
    done_while_paused = StepAttempt.objects.filter(run=run, outcome="succeeded").count()
    assert done_while_paused < 3
    services.run_resume(run_id=run.pk, reason="go on")
    run = finish(run)
    assert run.status == Run.Status.COMPLETED
    second = start(project, make_plan(steps=3, tool="sleep", args={"seconds": 0.05}))
    drain_jobs(until=lambda: StepAttempt.objects.filter(run=second, outcome="succeeded").count() >= 1)
    services.run_cancel(run_id=second.pk, reason="stop")
    drain_jobs(timeout=5)
    second.refresh_from_db()
    assert second.status == Run.Status.CANCELLED
    assert second.credits_charged + second.credits_refunded == second.credits_reserved
    assert invariants_check() == []


def test_repeated_errors_open_an_escalation(project):
    plan = {"agents": [{"name": "a", "failure_mode": "continue", "parallelism_mode": "parallel", "tasks": [
        {"name": f"t{n}", "steps": [{"name": "x", "tool": "fail", "args": {"mode": "retryable", "times": 9}}]}
        for n in range(3)]}]}
    run = finish(start(project, plan, failure_mode="continue"))
    ticket = EscalationTicket.objects.get(run=run)  # one incident, every trigger on it
    triggers = [entry["trigger"] for entry in ticket.triggers]
    assert {"error_burst", "error_rate", "retries_exhausted"} <= set(triggers)
    assert len(triggers) == len(set(triggers))  # a trigger that fires again on every failed try is listed once
    assert all(entry["at"] and entry["detail"] for entry in ticket.triggers)
    assert Event.objects.filter(run_id=run.pk, type="escalation_open").count() == 1
    updated = Event.objects.filter(run_id=run.pk, type="escalation_updated")
    assert sorted(event.payload["trigger"] for event in updated) == sorted(triggers[1:])


def test_a_run_that_fails_for_good_has_one_ticket_with_several_triggers(project, operator):
    plan = {"agents": [{"name": "a", "tasks": [
        {"name": "t", "steps": [{"name": "x", "tool": "fail", "args": {"mode": "retryable", "times": 99}}]}]}]}
    run = finish(start(project, plan))
    assert run.status == Run.Status.FAILED
    ticket = EscalationTicket.objects.get(run=run)
    assert len({entry["trigger"] for entry in ticket.triggers}) >= 2, ticket.triggers
    # an operator's escalation of the same run goes onto the same incident
    added, created = services.escalation_open(run=run, trigger="manual", detail="customer called", actor=operator,
                                              reason="customer called")
    assert (added.pk, created) == (ticket.pk, False)
    assert added.triggers[-1]["trigger"] == "manual" and added.triggers[-1]["detail"] == "customer called"
    assert EscalationTicket.objects.filter(run=run).count() == 1
    # once resolved, the next trigger opens a new incident
    services.escalation_resolve(ticket_id=ticket.pk, actor=operator, reason="fixed upstream")
    reopened, created = services.escalation_open(run=run, trigger="manual", detail="again", actor=operator)
    assert created and reopened.pk != ticket.pk and [e["trigger"] for e in reopened.triggers] == ["manual"]


def test_a_mostly_failed_run_is_replanned(project):
    plan = {"agents": [{"name": "solo", "tasks": [
        {"name": "flaky", "steps": [{"name": "x", "tool": "fail", "args": {"mode": "retryable", "times": 3}}]}]}]}
    run = finish(start(project, plan, credit_limit=20))
    assert run.replan_count == 1
    assert run.status == Run.Status.COMPLETED
    names = set(Agent.objects.filter(run=run).values_list("name", flat=True))
    assert "solo/flaky~replan1" in names
    assert Event.objects.filter(run_id=run.pk, type="run_replanned").exists()


def test_a_replan_reserves_its_own_budget_and_the_healed_run_completes(project):
    """The default credit limit covers the plan once: the re-plan holds the new work's worst case on top."""
    plan = {"agents": [{"name": "solo", "tasks": [
        {"name": "flaky", "steps": [{"name": "x", "tool": "fail", "args": {"mode": "retryable", "times": 3}}]}]}]}
    run = finish(start(project, plan))
    assert (run.status, run.replan_count, run.last_error_code) == (Run.Status.COMPLETED, 1, "")
    attempt = run.attempts.get()
    # the new task retries (up to 3 times): its worst case is 1 credit × 3 tries × 4 rounds
    assert attempt.credits_reserved == run.credit_limit + 12
    assert attempt.credits_charged + attempt.credits_refunded == attempt.credits_reserved
    keys = set(LedgerEntry.objects.filter(run_id=run.pk, kind="reserve").values_list("idempotency_key", flat=True))
    assert f"replan:{run.pk}:1:1" in keys
    assert Event.objects.get(run_id=run.pk, type="run_replanned").payload["credits_reserved"] == 12
    assert invariants_check() == []


def test_a_replan_the_organization_cannot_pay_fails_the_run_with_insufficient_credits(org_factory):
    organization, project, _owner = org_factory(credits=3)
    plan = {"agents": [{"name": "solo", "tasks": [
        {"name": "flaky", "steps": [{"name": "x", "tool": "fail", "args": {"mode": "retryable", "times": 3}}]}]}]}
    run = finish(start(project, plan))
    assert run.credit_limit == 3
    assert (run.status, run.last_error_code, run.replan_count) == (Run.Status.FAILED, "insufficient_credits", 0)
    assert "re-plan 1" in run.last_error
    assert run.credits_charged + run.credits_refunded == run.credits_reserved == 3
    assert account_balance(organization_id=organization.pk)["balance"] == 0
    assert invariants_check() == []


def test_a_run_level_retry_runs_a_second_attempt_for_transient_failures(project):
    plan = make_plan(agents=2, tool="fail", args={"mode": "retryable", "times": 9})
    run = finish(start(project, plan, failure_mode="retry", max_attempts=2))
    assert (run.status, run.attempt_number) == (Run.Status.FAILED, 2)
    assert run.attempts.count() == 2
    assert run.credits_reserved == 2 * run.credit_limit


def test_a_fatal_failure_is_not_retried_at_any_level(project):
    plan = {"agents": [{"name": "a", "failure_mode": "retry", "tasks": [
        {"name": "t", "failure_mode": "retry", "steps": [{"name": "s", "tool": "fail", "args": {"mode": "fatal"}}]}]}]}
    run = finish(start(project, plan, failure_mode="retry"))
    assert (run.status, run.attempt_number, run.last_error_code) == (Run.Status.FAILED, 1, "drill_fatal")
    assert StepAttempt.objects.filter(run=run).count() == 1
