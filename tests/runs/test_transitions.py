"""The run state machine, pair by pair (seed 001 §1.3, DESIGN §2.1).

Every run state is built through the services (``build_run_in_state``; for the table once per
module, inside a transaction rolled back at the end, each case acting in its own savepoint),
every action is called on it, and each (state, action) pair is its own test case: an allowed
transition reaches its target with its side effects (ledger, event, audit, timestamps,
attempts); a repeat into the current state is a no-op that writes nothing; anything else
raises ``InvalidTransition`` naming the run, its state and the action, and changes nothing.
"""

from __future__ import annotations

import pytest
from django.db import transaction

from billing.errors import InsufficientCredits
from billing.models import CreditAccount, LedgerEntry
from billing.selectors import account_balance, ledger_totals
from billing.services import organization_create
from core.errors import InvalidTransition
from core.models import AuditRecord, Event
from runs import services
from runs.invariants import invariants_check
from runs.models import LIVE_NODE_STATES, Agent, NodeStatus, Run, RunAttempt, Step, StepAttempt, Task
from tests.conftest import make_plan

STATES = [
    "created",
    "pending",
    "running",
    "paused",
    "resuming",
    "completed",
    "failed_retryable",
    "failed_exhausted",
    "cancelled",
    "retrying",
]
ACTIONS = [
    "run_start",
    "run_mark_running",
    "run_complete",
    "run_fail",
    "run_pause",
    "run_resume",
    "run_cancel",
    "run_retry",
    "run_requeue",
    "run_delete",
]
# Services an operator calls: they take an actor and then write an audit row.
ACTOR_ACTIONS = {"run_start", "run_complete", "run_fail", "run_pause", "run_resume", "run_cancel", "run_retry",
                 "run_delete"}

ALLOWED = {
    ("created", "run_start"): Run.Status.PENDING,
    ("pending", "run_mark_running"): Run.Status.RUNNING,
    ("resuming", "run_mark_running"): Run.Status.RUNNING,
    ("pending", "run_fail"): Run.Status.FAILED,
    ("running", "run_fail"): Run.Status.FAILED,
    ("resuming", "run_fail"): Run.Status.FAILED,
    ("retrying", "run_fail"): Run.Status.FAILED,
    ("running", "run_pause"): Run.Status.PAUSED,
    ("paused", "run_resume"): Run.Status.RESUMING,
    ("created", "run_cancel"): Run.Status.CANCELLED,
    ("pending", "run_cancel"): Run.Status.CANCELLED,
    ("running", "run_cancel"): Run.Status.CANCELLED,
    ("paused", "run_cancel"): Run.Status.CANCELLED,
    ("failed_retryable", "run_retry"): Run.Status.RETRYING,
    ("retrying", "run_requeue"): Run.Status.PENDING,
    ("created", "run_delete"): Run.Status.CREATED,  # a soft delete: the status stays
}
# Seed 001 §1.3 idempotency: asking for the state the run is already in returns it unchanged.
NOOPS = {
    ("pending", "run_start"),
    ("running", "run_mark_running"),
    ("completed", "run_complete"),
    ("failed_retryable", "run_fail"),
    ("failed_exhausted", "run_fail"),
    ("paused", "run_pause"),
    ("resuming", "run_resume"),
    ("cancelled", "run_cancel"),
    ("retrying", "run_retry"),
    ("pending", "run_requeue"),
}
ALL_PAIRS = [(state, action) for state in STATES for action in ACTIONS]
REFUSED = [pair for pair in ALL_PAIRS if pair not in ALLOWED and pair not in NOOPS]

STATUS_OF = {
    "created": Run.Status.CREATED,
    "pending": Run.Status.PENDING,
    "running": Run.Status.RUNNING,
    "paused": Run.Status.PAUSED,
    "resuming": Run.Status.RESUMING,
    "completed": Run.Status.COMPLETED,
    "failed_retryable": Run.Status.FAILED,
    "failed_exhausted": Run.Status.FAILED,
    "cancelled": Run.Status.CANCELLED,
    "retrying": Run.Status.RETRYING,
}
PLAN_STEPS = 3
CREDIT_LIMIT = 3 * PLAN_STEPS  # echo costs 1, three tries per step


@pytest.fixture
def operator(django_user_model):
    """A staff user without a password: hashing one costs more than the transition under test."""
    return django_user_model.objects.create_user(username="table-operator", is_staff=True)


def _ids(pairs):
    return [f"{state}-{action}" for state, action in pairs]


# --- building states through the services ---------------------------------------------------

def _current_step(run_id: int, name: str) -> Step:
    run = Run.objects.get(pk=run_id)
    return Step.objects.get(run=run, task__agent__attempt_number=run.attempt_number, name=name)


def _begin(run_id: int, name: str) -> StepAttempt:
    return services.step_begin(step_id=_current_step(run_id, name).pk)


def _succeed(run_id: int, name: str) -> None:
    attempt = _begin(run_id, name)
    assert services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True}).decision == "completed"


def build_run_in_state(project, state: str) -> Run:
    """A run of 1 agent × 1 task × 3 echo steps in ``state``, built by the services.

    From ``running`` on, step s0 has completed (1 credit charged) and s1 is in flight, so the
    settling transitions have both charged and unused credits to account for.
    """
    max_attempts = 2 if state == "failed_exhausted" else 3
    run = services.run_create(project=project, name=f"run {state}", plan=make_plan(steps=PLAN_STEPS),
                              max_attempts=max_attempts)
    assert run.credit_limit == CREDIT_LIMIT
    if state == "created":
        return Run.objects.get(pk=run.pk)
    services.run_start(run_id=run.pk)
    if state == "pending":
        return Run.objects.get(pk=run.pk)
    services.run_mark_running(run_id=run.pk)
    _succeed(run.pk, "s0")
    in_flight = _begin(run.pk, "s1")
    if state in ("paused", "resuming"):
        services.run_pause(run_id=run.pk)
        if state == "resuming":
            services.run_resume(run_id=run.pk)
    elif state == "completed":
        services.step_attempt_succeed(attempt_id=in_flight.pk, output={"ok": True})
        _succeed(run.pk, "s2")
    elif state in ("failed_retryable", "failed_exhausted", "retrying"):
        services.run_fail(run_id=run.pk, code="worker_lost", message="the worker went away")
        if state == "retrying":
            services.run_retry(run_id=run.pk)
        elif state == "failed_exhausted":
            services.run_retry(run_id=run.pk)
            services.run_requeue(run_id=run.pk)
            services.run_mark_running(run_id=run.pk)
            services.run_fail(run_id=run.pk, code="worker_lost", message="the worker went away again")
    elif state == "cancelled":
        services.run_cancel(run_id=run.pk)
    run = Run.objects.get(pk=run.pk)
    assert run.status == STATUS_OF[state]
    return run


@pytest.fixture
def run_in_state(project):
    """``build(state)`` → a new run in ``state`` (see ``build_run_in_state``)."""
    return lambda state: build_run_in_state(project, state)


@pytest.fixture(scope="module")
def table_runs(django_db_setup, django_db_blocker):
    """Every state built once for the transition table, each in its own organization.

    Built through the services inside a transaction that is rolled back after the module
    (like ``TestCase.setUpTestData``); each table case acts inside its own savepoint, so it
    starts from exactly this state and leaves nothing for the next one.
    """
    with django_db_blocker.unblock(), transaction.atomic():
        runs = {}
        for state in STATES:
            _, project, _, _ = organization_create(name=f"table {state}", owner_username=f"table owner {state}",
                                                   credits=1_000)
            runs[state] = build_run_in_state(project, state).pk
        yield runs
        transaction.set_rollback(True)


@pytest.fixture
def table_run(table_runs, db):
    return lambda state: Run.objects.get(pk=table_runs[state])


def _world(run: Run) -> dict:
    """Everything a transition could write, for before/after comparisons."""
    return {
        "run": Run.objects.filter(pk=run.pk).values().get(),
        "ledger": LedgerEntry.objects.count(),
        "events": Event.objects.count(),
        "audit": AuditRecord.objects.count(),
        "attempts": list(RunAttempt.objects.filter(run=run).order_by("number").values()),
        "agents": list(Agent.objects.filter(run=run).order_by("pk").values_list("pk", "status")),
        "tasks": list(Task.objects.filter(run=run).order_by("pk").values_list("pk", "status")),
        "steps": list(Step.objects.filter(run=run).order_by("pk").values_list("pk", "status", "attempts")),
        "step_attempts": list(StepAttempt.objects.filter(run=run).order_by("pk").values_list("pk", "outcome")),
        "account": CreditAccount.objects.filter(organization_id=run.organization_id)
        .values("balance", "reserved", "last_entry_hash").get(),
    }


def _call(action: str, run: Run, actor=None) -> Run:
    kwargs = {"run_id": run.pk}
    if action in ACTOR_ACTIONS:
        kwargs.update(actor=actor, reason="transition table")
    if action == "run_fail":
        kwargs.update(code="operator_abort", message="stopped from the transition table")
    return getattr(services, action)(**kwargs)


def _audit_action(action: str, actor) -> str:
    if action == "run_fail" and actor is not None:
        return "run_force_fail"
    return action


def _live_nodes(run: Run) -> list:
    live = []
    for model, filters in ((Agent, {"attempt_number": run.attempt_number}),
                           (Task, {"agent__attempt_number": run.attempt_number}),
                           (Step, {"task__agent__attempt_number": run.attempt_number})):
        live += list(model.objects.filter(run=run, status__in=LIVE_NODE_STATES, **filters))
    return live


# --- the table ------------------------------------------------------------------------------

def test_the_table_covers_every_pair():
    assert len(ALL_PAIRS) == 100
    assert len(ALLOWED) + len(NOOPS) + len(REFUSED) == len(ALL_PAIRS)
    assert not set(ALLOWED) & NOOPS


@pytest.mark.parametrize("state", STATES)
def test_states_built_through_services_hold_the_invariants(state, run_in_state):
    run = run_in_state(state)
    assert run.status == STATUS_OF[state]
    assert invariants_check() == []


@pytest.mark.parametrize(("state", "action"), list(ALLOWED), ids=_ids(ALLOWED))
def test_allowed_transition_reaches_its_target_with_side_effects(state, action, table_run, operator):
    run = table_run(state)
    before = _world(run)
    last_ledger = LedgerEntry.objects.order_by("-id").values_list("id", flat=True).first() or 0
    last_event = Event.objects.order_by("-id").values_list("id", flat=True).first() or 0
    last_audit = AuditRecord.objects.order_by("-id").values_list("id", flat=True).first() or 0
    old_attempt = run.attempt_number

    returned = _call(action, run, actor=operator)

    target = ALLOWED[(state, action)]
    run = Run.objects.get(pk=run.pk)
    assert returned.pk == run.pk
    assert returned.status == run.status == target

    # Exactly one run event, named after the state reached (or the soft delete).
    run_events = list(Event.objects.filter(id__gt=last_event, type__startswith="run_").values_list("type", "run_id"))
    expected_type = "run_deleted" if action == "run_delete" else f"run_{target}"
    assert run_events == [(expected_type, run.pk)]

    # An audit row for operator actions, naming who did it, to which run, and the states.
    audit = list(AuditRecord.objects.filter(id__gt=last_audit))
    if action in ACTOR_ACTIONS:
        assert len(audit) == 1
        record = audit[0]
        assert (record.action, record.actor_id, record.target_type, record.target_id, record.run_id) == (
            _audit_action(action, operator), operator.pk, "run", str(run.pk), run.pk)
        assert record.reason == "transition table"
        assert record.before["status"] == STATUS_OF[state]
        assert record.after["status"] == target
    else:
        assert audit == []

    # Ledger entries: a reservation on start and retry, a release of the unused rest when settling.
    new_entries = [(e.kind, e.source, e.amount, e.attempt_number, e.run_id)
                   for e in LedgerEntry.objects.filter(id__gt=last_ledger).order_by("id")]
    previous = before["attempts"][-1] if before["attempts"] else None
    if action == "run_start":
        assert new_entries == [("reserve", "", CREDIT_LIMIT, 1, run.pk)]
        assert run.credits_reserved == CREDIT_LIMIT
        attempt = RunAttempt.objects.get(run=run, number=1)
        assert attempt.credits_reserved == CREDIT_LIMIT
    elif action == "run_retry":
        assert new_entries == [("reserve", "", CREDIT_LIMIT, 2, run.pk)]
        assert run.attempt_number == old_attempt + 1 == 2
        assert RunAttempt.objects.get(run=run, number=2).credits_reserved == CREDIT_LIMIT
        assert run.credits_reserved == 2 * CREDIT_LIMIT
        assert run.status_reason == ""
        # Earlier agents, tasks and steps stay for audit; none exist yet for attempt 2.
        assert list(Agent.objects.filter(run=run).values_list("pk", "status")) == before["agents"]
        assert not Agent.objects.filter(run=run, attempt_number=2).exists()
    elif target in (Run.Status.FAILED, Run.Status.CANCELLED) and previous is not None:
        unused = previous["credits_reserved"] - previous["credits_charged"] - previous["credits_refunded"]
        assert unused > 0
        assert new_entries == [("refund", "reservation", unused, run.attempt_number, run.pk)]
    else:
        assert new_entries == []

    if target in (Run.Status.FAILED, Run.Status.CANCELLED):
        # Settled: every credit reserved is either charged or refunded, per attempt and per run.
        assert run.credits_charged + run.credits_refunded == run.credits_reserved
        assert ledger_totals(run_id=run.pk) == {"reserved": run.credits_reserved, "charged": run.credits_charged,
                                                "refunded": run.credits_refunded}
        for attempt in RunAttempt.objects.filter(run=run):
            assert attempt.credits_charged + attempt.credits_refunded == attempt.credits_reserved
            assert attempt.outcome in (Run.Status.FAILED, Run.Status.CANCELLED)
        assert account_balance(organization_id=run.organization_id)["reserved"] == 0
        assert run.duration_ms is not None and run.duration_ms >= 0
        assert _live_nodes(run) == []
        if target == Run.Status.FAILED:
            assert (run.last_error_code, run.last_error) == ("operator_abort", "stopped from the transition table")
            assert run.completed_at is not None
            assert run.cancelled_at is None
            assert RunAttempt.objects.get(run=run, number=run.attempt_number).error_code == "operator_abort"
        else:
            assert run.cancelled_at is not None
            assert run.completed_at is None
        assert StepAttempt.objects.filter(run=run, outcome=StepAttempt.Outcome.RUNNING).count() == 0

    if action == "run_mark_running":
        assert run.last_heartbeat is not None
        assert run.started_at is not None
        agents = Agent.objects.filter(run=run, attempt_number=run.attempt_number)
        assert agents.count() == 1
        if state == "pending":
            assert agents.get().status == NodeStatus.PENDING
            assert Task.objects.filter(run=run).count() == 1
            assert Step.objects.filter(run=run).count() == PLAN_STEPS
        else:  # resuming: the agents are back in play, started_at is kept
            assert run.started_at == before["run"]["started_at"]
            assert not agents.filter(status=NodeStatus.PAUSED).exists()
            assert services.runnable_steps(run)
    elif action == "run_pause":
        assert run.status_reason == "paused"
        assert not Agent.objects.filter(run=run, status__in=[NodeStatus.PENDING, NodeStatus.RUNNING]).exists()
        assert not Step.objects.filter(run=run, status__in=[NodeStatus.PENDING, NodeStatus.RUNNING]).exists()
        assert services.runnable_steps(run) == []
    elif action == "run_resume":
        assert run.status_reason == ""
        assert not Step.objects.filter(run=run, status=NodeStatus.PAUSED).exists()
        assert not Agent.objects.filter(run=run, status=NodeStatus.PAUSED).exists()
        assert services.runnable_steps(run) == []  # not until a worker marks it running
    elif action == "run_requeue":
        assert run.attempt_number == old_attempt
        assert not Agent.objects.filter(run=run, attempt_number=run.attempt_number).exists()
    elif action == "run_delete":
        assert run.deleted_at is not None
        assert not Run.objects.alive().filter(pk=run.pk).exists()
    elif action == "run_start":
        assert not Agent.objects.filter(run=run).exists()

    if action not in ("run_start", "run_retry") and target not in (Run.Status.FAILED, Run.Status.CANCELLED):
        assert (run.credits_reserved, run.credits_charged, run.credits_refunded) == (
            before["run"]["credits_reserved"], before["run"]["credits_charged"], before["run"]["credits_refunded"])
    assert invariants_check() == []


@pytest.mark.parametrize(("state", "action"), sorted(NOOPS), ids=_ids(sorted(NOOPS)))
def test_repeating_the_current_state_is_a_noop(state, action, table_run, operator):
    run = table_run(state)
    before = _world(run)

    returned = _call(action, run, actor=operator)

    assert returned.pk == run.pk
    assert returned.status == STATUS_OF[state]
    assert returned.attempt_number == run.attempt_number
    assert _world(run) == before
    if action == "run_fail":
        assert returned.last_error_code == "worker_lost"  # the existing error, not the new one


@pytest.mark.parametrize(("state", "action"), REFUSED, ids=_ids(REFUSED))
def test_forbidden_transition_raises_and_changes_nothing(state, action, table_run, operator):
    run = table_run(state)
    before = _world(run)
    requested = action.removeprefix("run_")

    with pytest.raises(InvalidTransition) as raised:
        _call(action, run, actor=operator)

    error = raised.value
    assert (error.entity_id, error.current, error.requested) == (run.pk, run.status, requested)
    assert str(error).startswith(f"run {run.pk} is {run.status}; cannot {requested}")
    assert error.code == "invalid_transition" and error.status == 409
    assert _world(run) == before


# --- around the table -----------------------------------------------------------------------

@pytest.mark.parametrize("action", ["run_start", "run_pause", "run_cancel", "run_fail"])
def test_system_transitions_write_no_audit_row(action, run_in_state):
    run = run_in_state({"run_start": "created", "run_pause": "running", "run_cancel": "running",
                        "run_fail": "running"}[action])
    audit_before = AuditRecord.objects.count()
    _call(action, run, actor=None)
    assert AuditRecord.objects.count() == audit_before
    assert Event.objects.filter(run_id=run.pk, type__startswith="run_").latest("id").payload["actor"] == "system"


def test_retry_refused_once_attempts_are_exhausted_says_why(run_in_state):
    run = run_in_state("failed_exhausted")
    assert run.is_terminal
    with pytest.raises(InvalidTransition, match=r"attempts exhausted \(2 of 2\)"):
        services.run_retry(run_id=run.pk)


def test_run_complete_refused_while_agents_are_live(run_in_state):
    run = run_in_state("running")
    before = _world(run)
    with pytest.raises(InvalidTransition) as raised:
        services.run_complete(run_id=run.pk)
    assert str(raised.value) == (f"run {run.pk} is running; cannot complete: "
                                 f"not every agent is done with at least one completed")
    assert _world(run) == before


def test_completion_charges_what_was_used_and_releases_the_rest(run_in_state):
    run = run_in_state("completed")
    entries = [(e.kind, e.source, e.amount, e.attempt_number)
               for e in LedgerEntry.objects.filter(run=run).order_by("id")]
    assert entries == [("reserve", "", 9, 1), ("charge", "", 1, 1), ("charge", "", 1, 1), ("charge", "", 1, 1),
                       ("refund", "reservation", 6, 1)]
    assert (run.credits_reserved, run.credits_charged, run.credits_refunded) == (9, 3, 6)
    assert run.credits_charged + run.credits_refunded == run.credits_reserved
    assert run.completed_at is not None and run.duration_ms is not None and run.cancelled_at is None
    assert run.duration_ms == int((run.completed_at - run.started_at).total_seconds() * 1000)
    attempt = RunAttempt.objects.get(run=run)
    assert (attempt.outcome, attempt.credits_charged, attempt.credits_refunded) == ("completed", 3, 6)
    assert set(Agent.objects.filter(run=run).values_list("status", flat=True)) == {NodeStatus.COMPLETED}
    assert Event.objects.filter(run_id=run.pk, type="run_completed").count() == 1
    assert account_balance(organization_id=run.organization_id) == {
        "organization": run.organization_id, "balance": 997, "reserved": 0, "available": 997}
    assert invariants_check() == []


def test_start_without_enough_credits_leaves_the_run_created(org_factory):
    organization, project, _ = org_factory(credits=10)
    first = services.run_create(project=project, name="first", plan=make_plan(steps=2))  # needs 6
    second = services.run_create(project=project, name="second", plan=make_plan(steps=2))  # 6 of 10: fine
    services.run_start(run_id=first.pk)
    before = _world(second)

    with pytest.raises(InsufficientCredits) as raised:
        services.run_start(run_id=second.pk)

    assert raised.value.code == "insufficient_credits" and raised.value.status == 402
    assert raised.value.extra == {"available": 4, "required": 6}
    assert _world(second) == before
    second.refresh_from_db()
    assert second.status == Run.Status.CREATED
    assert not RunAttempt.objects.filter(run=second).exists()
    assert not LedgerEntry.objects.filter(run=second).exists()
    # Nothing half-started: once credits are freed the same run starts normally.
    services.run_cancel(run_id=first.pk)
    assert services.run_start(run_id=second.pk).status == Run.Status.PENDING
    assert invariants_check() == []


def test_create_without_enough_credits_creates_no_run(org_factory):
    organization, project, _ = org_factory(credits=5)
    counts = (Run.objects.count(), Event.objects.count(), AuditRecord.objects.count(), LedgerEntry.objects.count())
    with pytest.raises(InsufficientCredits, match="has 5 credits available; the run needs 6"):
        services.run_create(project=project, name="too big", plan=make_plan(steps=2))
    with pytest.raises(InsufficientCredits):
        services.run_create(project=project, name="too big", plan=make_plan(), credit_limit=6)
    assert (Run.objects.count(), Event.objects.count(), AuditRecord.objects.count(),
            LedgerEntry.objects.count()) == counts


def test_create_records_the_run_and_its_creator(project, operator):
    run = services.run_create(project=project, name="  named  ", plan=make_plan(), actor=operator, reason="why")
    assert (run.status, run.name, run.created_by_id, run.attempt_number, run.credits_reserved) == (
        Run.Status.CREATED, "named", operator.pk, 1, 0)
    assert Event.objects.filter(run_id=run.pk).values_list("type", flat=True).get() == "run_created"
    record = AuditRecord.objects.get(run_id=run.pk)
    assert (record.action, record.actor_id, record.reason) == ("run_create", operator.pk, "why")


def test_soft_delete_only_for_created_runs_and_deleted_runs_cannot_start(run_in_state, operator):
    run = run_in_state("created")
    services.run_delete(run_id=run.pk, actor=operator, reason="not needed")
    run.refresh_from_db()
    deleted_at = run.deleted_at
    assert deleted_at is not None
    assert Run.objects.filter(pk=run.pk).exists()  # soft: the row stays
    before = _world(run)

    # Deleting again is a no-op.
    assert services.run_delete(run_id=run.pk, actor=operator).deleted_at == deleted_at
    assert _world(run) == before

    with pytest.raises(InvalidTransition) as raised:
        services.run_start(run_id=run.pk, actor=operator)
    assert str(raised.value) == f"run {run.pk} is created; cannot start: deleted"
    assert _world(run) == before


def test_retry_without_enough_credits_keeps_the_run_failed(org_factory):
    organization, project, _ = org_factory(credits=6)
    run = services.run_create(project=project, name="tight", plan=make_plan(steps=2))  # reserves 6
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    _succeed(run.pk, "s0")  # 1 charged: 5 left
    services.run_fail(run_id=run.pk, code="worker_lost", message="gone")
    run.refresh_from_db()
    before = _world(run)

    with pytest.raises(InsufficientCredits):
        services.run_retry(run_id=run.pk)

    assert _world(run) == before
    assert (run.status, run.attempt_number) == (Run.Status.FAILED, 1)
    assert invariants_check() == []


def test_a_retried_run_runs_a_fresh_hierarchy_and_keeps_the_old_one(run_in_state):
    run = run_in_state("retrying")
    old = list(Agent.objects.filter(run=run, attempt_number=1).values_list("pk", "status"))
    services.run_requeue(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    for name in ("s0", "s1", "s2"):
        _succeed(run.pk, name)
    run.refresh_from_db()
    assert (run.status, run.attempt_number) == (Run.Status.COMPLETED, 2)
    assert list(Agent.objects.filter(run=run, attempt_number=1).values_list("pk", "status")) == old
    assert Agent.objects.filter(run=run, attempt_number=2, status=NodeStatus.COMPLETED).count() == 1
    assert [(a.number, a.outcome) for a in RunAttempt.objects.filter(run=run)] == [(1, "failed"), (2, "completed")]
    # Attempt 1: 1 charged (s0) + 8 released; attempt 2: 3 charged + 6 released.
    assert (run.credits_reserved, run.credits_charged, run.credits_refunded) == (18, 4, 14)
    assert invariants_check() == []


def test_a_start_the_queue_has_no_room_for_leaves_the_run_created(run_in_state, settings):
    from jobs.errors import QueueFull
    from jobs.models import Job

    run = run_in_state("created")
    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = 0  # no job may wait in the project
    balance = account_balance(organization_id=run.organization_id)
    with pytest.raises(QueueFull):
        services.run_start(run_id=run.pk)
    run.refresh_from_db()
    assert (run.status, run.credits_reserved) == (Run.Status.CREATED, 0)
    assert not Job.objects.filter(run_id=run.pk).exists() and not RunAttempt.objects.filter(run=run).exists()
    assert account_balance(organization_id=run.organization_id) == balance
    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = 10  # room again: the same start goes through
    assert services.run_start(run_id=run.pk).status == Run.Status.PENDING
    assert Job.objects.filter(run_id=run.pk).count() == 1
    assert invariants_check() == []


def test_start_queues_the_job_that_starts_the_run_in_its_own_transaction(run_in_state, django_capture_on_commit_callbacks):
    from jobs.models import Job

    run = run_in_state("created")
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        services.run_start(run_id=run.pk)
        tick = Job.objects.get(run_id=run.pk)  # written with the start: committed with it or not at all
    # a run_step job with its run alone: it starts the run, then runs its first step (``_start``)
    assert (tick.type, tick.state, tick.payload, tick.priority) == ("run_step", "queued", {"run": run.pk}, run.priority)
    assert (tick.project_id, tick.organization_id) == (run.project_id, run.organization_id)
    assert callbacks  # the workers' wake-up (and the transition's log line) wait for the commit
    # A repeated start (already pending) queues nothing more.
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        services.run_start(run_id=run.pk)
    assert callbacks == [] and Job.objects.filter(run_id=run.pk).count() == 1
