"""Property: whatever operators and workers do to a few runs, credits are conserved.

Hypothesis draws sequences of actions (create, start, mark running, begin a step, finish it
with success or a retryable or fatal failure, complete, fail, cancel, pause, resume, retry,
requeue, refund, top up) over a few runs of one organization with limited credits. After
every action ``invariants_check()`` is empty (per attempt ``reserved >= charged >= 0``,
settled attempts ``charged + refunded == reserved``, account == ledger sums, hash chain,
hierarchy and state consistency) and the organization's available credits are never
negative. Forbidden actions raise a domain error and write nothing.

Each example builds its state through the services inside a transaction that is rolled
back at the end, so examples are independent on SQLite and on PostgreSQL alike.
"""

from __future__ import annotations

from unittest import mock

import pytest
from django.db import transaction
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from billing.errors import InsufficientCredits
from billing.models import CreditAccount, LedgerEntry
from billing.services import account_topup, organization_create
from core.errors import InvalidTransition, ValidationFailed
from core.models import Event
from runs import services
from runs.invariants import invariants_check
from runs.models import Run, StepAttempt

EXPECTED_ERRORS = (InvalidTransition, InsufficientCredits, ValidationFailed)
STARTING_CREDITS = 20
RUN_SLOTS = 3


class Rollback(Exception):
    """Raised at the end of an example to undo everything it wrote."""


def _plan(variant: int) -> dict:
    """Small plans (worst-case cost 6, 6 and 9 credits): sequential steps; two agents, one continuing
    on failure and one retrying its task; parallel tasks and steps with a continuing task."""
    if variant == 0:
        return {"agents": [{"name": "a", "tasks": [{"name": "t", "steps": [
            {"name": "s0", "tool": "echo", "args": {"text": "x"}},
            {"name": "s1", "tool": "echo", "args": {"text": "y"}}]}]}]}
    if variant == 1:
        return {"agents": [
            {"name": "a", "failure_mode": "continue", "tasks": [
                {"name": "t", "steps": [{"name": "s", "tool": "echo", "args": {"text": "x"}}]}]},
            {"name": "b", "tasks": [
                {"name": "t", "failure_mode": "retry", "steps": [
                    {"name": "s", "tool": "echo", "args": {"text": "y"}}]}]},
        ]}
    return {"agents": [{"name": "a", "parallelism_mode": "parallel", "tasks": [
        {"name": "t0", "failure_mode": "continue", "parallelism_mode": "parallel", "steps": [
            {"name": "s0", "tool": "echo", "args": {"text": "x"}},
            {"name": "s1", "tool": "sleep", "args": {"seconds": 0}}]},
        {"name": "t1", "steps": [{"name": "s0", "tool": "echo", "args": {"text": "z"}}]}]}]}


RUN_CONFIG = st.tuples(st.integers(0, 2), st.sampled_from(["fail-fast", "continue", "retry"]),
                       st.sampled_from([None, None, 1, 2, 4]), st.integers(1, 3))

# ``advance`` does the next natural thing for a run (what a worker would do), so that runs
# get somewhere; the other actions are operators' and workers' moves at random moments.
ACTION_NAMES = ["advance"] * 16 + ["fail_step"] * 2 + ["refund"] * 2 + [
    "create", "start", "mark_running", "begin", "succeed", "complete", "fail", "cancel", "pause", "resume",
    "retry", "requeue", "topup",
]
# (action, which run, a parameter: the run config, retryable or not, a refund or top-up amount)
ACTIONS = st.tuples(st.sampled_from(ACTION_NAMES), st.integers(0, RUN_SLOTS - 1), st.integers(0, 3), RUN_CONFIG)
REFUND_AMOUNTS = [None, 1, 2, 5]
TOPUP_AMOUNTS = [1, 5, 0, 3]


def _open_attempt(run_id: int) -> StepAttempt:
    attempt = (StepAttempt.objects.filter(run_id=run_id, outcome=StepAttempt.Outcome.RUNNING)
               .order_by("id").first())
    if attempt is None:
        raise InvalidTransition(entity="run", entity_id=run_id, current="-", requested="finish step",
                                why="no step attempt in flight")
    return attempt


def _next_move(run_id: int) -> str:
    status = Run.objects.values_list("status", flat=True).get(pk=run_id)
    if status == Run.Status.RUNNING:
        in_flight = StepAttempt.objects.filter(run_id=run_id, outcome=StepAttempt.Outcome.RUNNING).exists()
        return "succeed" if in_flight else "begin"
    return {Run.Status.CREATED: "start", Run.Status.PENDING: "mark_running", Run.Status.RESUMING: "mark_running",
            Run.Status.RETRYING: "requeue", Run.Status.PAUSED: "resume", Run.Status.FAILED: "retry"}.get(status,
                                                                                                     "refund")


def _perform(action: tuple, *, project, runs: list[int], counter: list[int]) -> None:
    name, which, parameter, config = action
    if name == "create":
        variant, failure_mode, credit_limit, max_attempts = config
        run = services.run_create(project=project, name=f"p{len(runs)}", plan=_plan(variant),
                                  failure_mode=failure_mode, credit_limit=credit_limit, max_attempts=max_attempts)
        runs.append(run.pk)
        return
    if name == "topup":
        counter[0] += 1
        account_topup(organization_id=project.organization_id, amount=TOPUP_AMOUNTS[parameter],
                      reason="property top-up", idempotency_key=f"topup-{counter[0]}")
        return
    if not runs:
        return
    run_id = runs[which % len(runs)]
    if name == "advance":
        name = _next_move(run_id)
    if name == "start":
        services.run_start(run_id=run_id)
    elif name == "mark_running":
        services.run_mark_running(run_id=run_id)
    elif name == "begin":
        steps = services.runnable_steps(Run.objects.get(pk=run_id))
        if not steps:
            raise InvalidTransition(entity="run", entity_id=run_id, current="-", requested="begin step",
                                    why="nothing runnable")
        services.step_begin(step_id=steps[0].pk)
    elif name == "succeed":
        services.step_attempt_succeed(attempt_id=_open_attempt(run_id).pk, output={"ok": True})
    elif name == "fail_step":
        services.step_attempt_fail(attempt_id=_open_attempt(run_id).pk, code="drill", message="drill",
                                   retryable=parameter % 2 == 0)
    elif name == "complete":
        services.run_complete(run_id=run_id)
    elif name == "fail":
        services.run_fail(run_id=run_id, code="operator_fail", message="failed by the property test")
    elif name == "cancel":
        services.run_cancel(run_id=run_id, reason="property cancel")
    elif name == "pause":
        services.run_pause(run_id=run_id)
    elif name == "resume":
        services.run_resume(run_id=run_id)
    elif name == "retry":
        services.run_retry(run_id=run_id)
    elif name == "requeue":
        services.run_requeue(run_id=run_id)
    elif name == "refund":
        counter[0] += 1
        services.run_refund(run_id=run_id, amount=REFUND_AMOUNTS[parameter], reason="property refund",
                            idempotency_key=f"refund-{counter[0]}")
    else:  # pragma: no cover - a typo in ACTIONS
        raise AssertionError(f"unknown action {name}")


def _written() -> tuple[int, int]:
    return LedgerEntry.objects.count(), Event.objects.count()


def _check(organization_id: int, trail: list) -> None:
    violations = invariants_check()
    assert violations == [], f"after {trail}: {[str(v) for v in violations]}"
    account = CreditAccount.objects.get(organization_id=organization_id)
    assert account.available >= 0, f"after {trail}: available {account.available}"
    assert account.reserved >= 0


# Hand-written paths that must always be covered, whatever the generator draws.
_SEQUENTIAL = (0, "fail-fast", None, 3)
_TIGHT = (0, "retry", 1, 3)
_TWO_AGENTS = (1, "continue", None, 2)


def _moves(*names: str, run: int = 0, parameter: int = 0, config=_SEQUENTIAL) -> list[tuple]:
    return [(name, run, parameter, config) for name in names]


RETRY_THEN_REFUND = (
    _moves("advance", "advance", "advance", "advance", "begin")  # start, running, s0 ok, begin s1
    + _moves("fail_step", parameter=1)  # fatal: the step, task, agent and run fail
    + _moves(*["advance"] * 7)  # retry, requeue, running, s0 begin/succeed, s1 begin/succeed → completed
    + _moves("refund", parameter=1) + _moves("advance") + _moves("refund", parameter=2)  # 1, the rest, nothing left
)
CREDIT_LIMIT_AND_AUTOMATIC_RETRY = (
    _moves(*["advance"] * 6, config=_TIGHT)  # s0 charges the whole reservation; s1 exceeds it → failed → retry
    + _moves("topup", parameter=2) + _moves("topup", parameter=1)  # 0 refused, then 5
    + _moves(*["advance"] * 8, config=_TIGHT)  # attempt 2 fails the same way → attempt 3
    + _moves("fail", config=_TIGHT) + _moves("retry", config=_TIGHT)  # attempts exhausted: retry refused
)
PAUSE_WITH_A_STEP_IN_FLIGHT = (
    _moves("advance", "advance", "advance", "pause", config=_TWO_AGENTS)
    + _moves("fail_step", config=_TWO_AGENTS)  # retryable, while paused: the step waits for the resume
    + _moves("resume", "complete", "advance", "advance", "advance", "succeed", "advance", "advance", "cancel",
             config=_TWO_AGENTS)  # completes; a late cancel is refused
    + _moves("start", "advance", "advance", "advance", "pause", "cancel", run=1, config=_TWO_AGENTS)
)


@pytest.mark.django_db
@example(first_runs=[_SEQUENTIAL], actions=RETRY_THEN_REFUND)
@example(first_runs=[_TIGHT, _SEQUENTIAL], actions=CREDIT_LIMIT_AND_AUTOMATIC_RETRY)
@example(first_runs=[_TWO_AGENTS, _TWO_AGENTS], actions=PAUSE_WITH_A_STEP_IN_FLIGHT)
@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(first_runs=st.lists(RUN_CONFIG, min_size=1, max_size=2),
       actions=st.lists(ACTIONS, min_size=12, max_size=24))
def test_credits_are_conserved_whatever_happens(first_runs, actions):
    try:
        # Retry backoff (100 ms and up) is not what this property is about: make waits zero.
        with transaction.atomic(), mock.patch("runs.services.steps.step_backoff_ms", return_value=0):
            organization, project, _, _ = organization_create(name="property", owner_username="property-owner",
                                                              credits=STARTING_CREDITS)
            runs: list[int] = []
            counter = [0]
            trail: list = []  # (action, outcome) so far, shown when a check fails
            for action in [("create", 0, 0, config) for config in first_runs] + actions:
                before = _written()
                try:
                    _perform(action, project=project, runs=runs, counter=counter)
                except EXPECTED_ERRORS as exc:
                    # A refused action writes nothing at all.
                    assert _written() == before, f"{action} raised {exc!r} but wrote rows"
                    trail.append((action, type(exc).__name__))
                else:
                    trail.append((action, "ok"))
                _check(organization.pk, trail)
            # Settle everything still open: conservation must still hold with every run settled.
            for run_id in runs:
                run = Run.objects.get(pk=run_id)
                if run.status in (Run.Status.CREATED, Run.Status.PENDING, Run.Status.RUNNING, Run.Status.PAUSED):
                    services.run_cancel(run_id=run_id, reason="end of example")
                elif run.status in (Run.Status.RESUMING, Run.Status.RETRYING):
                    services.run_fail(run_id=run_id, code="end_of_example", message="end of example")
            _check(organization.pk, trail + ["settle all"])
            account = CreditAccount.objects.get(organization_id=organization.pk)
            assert account.reserved == 0, f"after {trail}: credits still held with every run settled"
            raise Rollback
    except Rollback:
        pass
