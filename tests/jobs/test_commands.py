"""The execution command boundary (seed 000 AG-EXE-01) and the ``command`` job type.

Side effects are counted through the reference adapter's ``AdapterCall`` rows (one per write
call, committed with its effect) and the ``Deployment``/``Order`` rows themselves.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from billing.models import LedgerEntry
from billing.selectors import account_balance
from billing.services import account_topup
from core.errors import NotFound, ValidationFailed
from core.models import AuditRecord, Event
from jobs import tools
from jobs.commands import selectors
from jobs.commands.adapters import DatabaseAdapter, ExecutionAdapter, adapter_get
from jobs.commands.services import CommandFailed, command_execute
from jobs.commands.validation import payload_hash
from jobs.errors import CommandConflict
from jobs.executor import job_run_claimed
from jobs.models import (
    AdapterCall,
    CommandRecord,
    CommandStatus,
    Deployment,
    Job,
    JobReason,
    JobState,
    Order,
)
from jobs.registry import JobCancelled
from jobs.services import job_claim, job_enqueue
from jobs import tools
from runs.invariants import invariants_check

COMMAND_EVENTS = ("command_recorded", "command_succeeded", "command_failed")


def command_events(**filters):
    return list(Event.objects.filter(type__in=COMMAND_EVENTS, **filters).order_by("id").values_list("type", flat=True))


def calls(operation=None, key=None):
    rows = AdapterCall.objects.all()
    if operation:
        rows = rows.filter(operation=operation)
    if key:
        rows = rows.filter(idempotency_key=key)
    return rows.count()


def deploy(project, key="deploy-1", name="web", **extra):
    return command_execute(project=project, kind="create_deployment", args={"name": name, **extra},
                           idempotency_key=key)


class CrashAfterEffect(DatabaseAdapter):
    """Performs the effect, then loses the answer (``crashes`` times): a worker dying mid-call."""

    crashes = 0
    error: type[BaseException] = ConnectionError

    def create_deployment(self, **kwargs):
        result = super().create_deployment(**kwargs)
        if CrashAfterEffect.crashes > 0:
            CrashAfterEffect.crashes -= 1
            raise CrashAfterEffect.error("connection lost after the provider answered")
        return result


@pytest.fixture
def crashing_adapter(settings):
    settings.ORCHESTRATOR_EXECUTION_ADAPTER = "tests.jobs.test_commands.CrashAfterEffect"
    CrashAfterEffect.crashes = 1
    CrashAfterEffect.error = ConnectionError
    yield CrashAfterEffect
    CrashAfterEffect.crashes = 0


@pytest.fixture
def tool(monkeypatch):
    """Register tools for one test only."""
    monkeypatch.setattr(tools, "_REGISTRY", dict(tools._REGISTRY))

    def register(name, func, **options):
        tools.register_tool(name, cost=1, **options)(func)
        return tools.tool_get(name)

    return register


def run_next(worker="test", now=None):
    job = job_claim(worker=worker, now=now)
    assert job is not None
    job_run_claimed(job, worker=worker)
    job.refresh_from_db()
    return job


# --- command_execute ----------------------------------------------------------------------

def test_the_reference_adapter_satisfies_the_protocol(db):
    assert isinstance(adapter_get(), ExecutionAdapter)
    assert adapter_get().ping() is True


def test_a_command_is_recorded_before_the_adapter_runs(project):
    seen = {}

    class Observing(DatabaseAdapter):
        def create_deployment(self, **kwargs):
            record = CommandRecord.objects.get(project=project, idempotency_key=kwargs["idempotency_key"])
            seen.update(status=record.status, attempts=record.attempts, events=command_events())
            return super().create_deployment(**kwargs)

    outcome = command_execute(project=project, kind="create_deployment", args={"name": "web"},
                              idempotency_key="k1", adapter=Observing())
    assert seen == {"status": "recorded", "attempts": 1, "events": ["command_recorded"]}
    record = outcome.command
    assert (record.status, record.attempts, record.kind) == (CommandStatus.SUCCEEDED, 1, "create_deployment")
    assert record.payload_hash == payload_hash({"name": "web", "spec": {}})
    assert record.completed_at is not None and record.result == outcome.result
    assert outcome.replayed is False
    assert outcome.result["name"] == "web" and outcome.result["status"] == "active"
    assert command_events() == ["command_recorded", "command_succeeded"]


def test_a_replay_returns_the_recorded_result_without_a_second_side_effect(project):
    first = deploy(project)
    second = deploy(project)
    assert second.replayed is True
    assert second.result == first.result
    assert second.command.pk == first.command.pk and second.command.attempts == 1
    assert Deployment.objects.count() == 1
    assert calls("create_deployment") == 1
    assert command_events() == ["command_recorded", "command_succeeded"]


def test_equivalent_arguments_hash_alike(project):
    first = command_execute(project=project, kind="place_order", idempotency_key="o1",
                            args={"symbol": "ABC", "side": "buy", "quantity": 1})
    second = command_execute(project=project, kind="place_order", idempotency_key="o1",
                             args={"quantity": "1.000", "side": "buy", "symbol": "ABC"})
    assert second.replayed and second.result == first.result
    assert first.result["quantity"] == "1"
    assert Order.objects.count() == 1 and calls("place_order") == 1


def test_the_same_key_with_another_payload_is_a_conflict(project):
    deploy(project, name="web")
    with pytest.raises(CommandConflict) as conflict:
        deploy(project, name="api")
    assert conflict.value.code == "command_conflict" and conflict.value.status == 409
    assert conflict.value.extra["idempotency_key"] == "deploy-1"
    assert CommandRecord.objects.count() == 1 and Deployment.objects.get().name == "web"
    assert calls() == 1


def test_keys_are_scoped_by_project_and_kind(org_factory):
    _, first, _ = org_factory()
    _, second, _ = org_factory()
    deploy(first, key="same")
    deploy(second, key="same", name="other")
    command_execute(project=first, kind="place_order", idempotency_key="same",
                    args={"symbol": "ABC", "side": "sell", "quantity": "2.5", "price": 10})
    assert CommandRecord.objects.count() == 3
    assert Deployment.objects.count() == 2 and Order.objects.count() == 1


def test_a_crash_after_the_effect_is_replayed_with_the_same_key_and_the_effect_happens_once(
        project, crashing_adapter):
    with pytest.raises(CommandFailed) as failed:
        deploy(project)
    assert failed.value.retryable is True and failed.value.reason == "retryable_error"
    record = CommandRecord.objects.get()
    assert (record.status, record.attempts, record.result) == (CommandStatus.RECORDED, 1, None)
    assert "connection lost" in record.error
    assert Deployment.objects.count() == 1  # the effect happened, its answer was lost

    outcome = deploy(project)  # the crashing adapter now answers
    assert outcome.replayed is False
    assert calls("create_deployment", "deploy-1") == 2  # the adapter was called again, same key
    assert Deployment.objects.count() == 1  # ... and the effect exists once
    assert outcome.result["id"] == Deployment.objects.get().pk
    outcome.command.refresh_from_db()
    assert (outcome.command.status, outcome.command.attempts) == (CommandStatus.SUCCEEDED, 2)
    assert command_events() == ["command_recorded", "command_failed", "command_succeeded"]
    assert Event.objects.get(type="command_failed").payload["final"] is False


def test_a_worker_that_died_mid_call_leaves_a_recorded_command_that_a_replay_finishes(project, crashing_adapter):
    crashing_adapter.error = SystemExit  # the process dies: nothing after the call runs
    with pytest.raises(SystemExit):
        deploy(project)
    record = CommandRecord.objects.get()
    assert (record.status, record.error, record.attempts) == (CommandStatus.RECORDED, "", 1)
    assert command_events() == ["command_recorded"]

    outcome = deploy(project)
    assert outcome.command.status == CommandStatus.SUCCEEDED and outcome.command.attempts == 2
    assert calls("create_deployment") == 2 and Deployment.objects.count() == 1


def test_a_final_failure_is_recorded_and_replayed_without_calling_the_adapter(project):
    with pytest.raises(CommandFailed) as failed:
        command_execute(project=project, kind="stop_deployment", args={"deployment_id": 999}, idempotency_key="s1")
    assert (failed.value.retryable, failed.value.reason) == (False, "not_found")
    record = CommandRecord.objects.get()
    assert record.status == CommandStatus.FAILED and record.error_code == "not_found"
    with pytest.raises(CommandFailed) as again:
        command_execute(project=project, kind="stop_deployment", args={"deployment_id": 999}, idempotency_key="s1")
    assert again.value.reason == "not_found" and again.value.retryable is False
    assert calls("stop_deployment") == 1
    assert command_events() == ["command_recorded", "command_failed"]
    assert Event.objects.get(type="command_failed").payload["final"] is True


def test_deployment_and_order_lifecycle(project):
    deployment = deploy(project).result
    order = command_execute(project=project, kind="place_order", idempotency_key="o1",
                            args={"symbol": "ABC", "side": "buy", "quantity": "3", "price": "9.5",
                                  "deployment_id": deployment["id"]}).result
    assert (order["deploymentId"], order["price"], order["status"]) == (deployment["id"], "9.5", "open")
    cancelled = command_execute(project=project, kind="cancel_order", args={"order_id": order["id"]},
                                idempotency_key="c1").result
    assert cancelled["status"] == "cancelled"
    # Another key for the same cancellation: the adapter is idempotent by state as well.
    assert command_execute(project=project, kind="cancel_order", args={"order_id": order["id"]},
                           idempotency_key="c2").result["status"] == "cancelled"
    stopped = command_execute(project=project, kind="stop_deployment", args={"deployment_id": deployment["id"]},
                              idempotency_key="s1").result
    assert stopped["status"] == "stopped" and Deployment.objects.get().stopped_at is not None
    with pytest.raises(CommandFailed) as rejected:
        command_execute(project=project, kind="place_order", idempotency_key="o2",
                        args={"symbol": "ABC", "side": "buy", "quantity": 1, "deployment_id": deployment["id"]})
    assert rejected.value.reason == "rejected"
    assert Order.objects.count() == 1


def test_reads_go_to_the_adapter_without_a_record(project, org_factory):
    _, other, _ = org_factory()
    deployment = deploy(project).result
    order = command_execute(project=project, kind="place_order", idempotency_key="o1",
                            args={"symbol": "ABC", "side": "buy", "quantity": 1,
                                  "deployment_id": deployment["id"]}).result
    records, events, adapter_calls = CommandRecord.objects.count(), Event.objects.count(), AdapterCall.objects.count()
    assert selectors.deployment_list(project=project) == [deployment]
    assert selectors.deployment_get(project=project, deployment_id=deployment["id"]) == deployment
    assert selectors.order_list(project=project) == [order]
    assert selectors.order_list(project=project, deployment_id=deployment["id"] + 1) == []
    assert selectors.order_get(project=project, order_id=order["id"]) == order
    with pytest.raises(NotFound):
        selectors.order_get(project=project, order_id=order["id"] + 1)
    with pytest.raises(NotFound):  # another project's rows are not visible
        selectors.deployment_get(project=other, deployment_id=deployment["id"])
    assert (CommandRecord.objects.count(), Event.objects.count(), AdapterCall.objects.count()) == (
        records, events, adapter_calls)


@pytest.mark.parametrize("kind, args, key, field", [
    ("launch_rocket", {}, "k", "kind"),
    ("create_deployment", {}, "k", "args.name"),
    ("create_deployment", {"name": "web", "spec": []}, "k", "args.spec"),
    ("create_deployment", {"name": "web", "color": "red"}, "k", "args.color"),
    ("create_deployment", {"name": "web"}, "", "idempotency_key"),
    ("create_deployment", {"name": "web"}, None, "idempotency_key"),
    ("create_deployment", {"name": "web"}, "x" * 201, "idempotency_key"),
    ("stop_deployment", {"deployment_id": "1"}, "k", "args.deployment_id"),
    ("place_order", {"symbol": "A", "side": "hold", "quantity": 1}, "k", "args.side"),
    ("place_order", {"symbol": "A", "side": "buy", "quantity": -1}, "k", "args.quantity"),
    ("place_order", {"symbol": "A", "side": "buy", "quantity": "NaN"}, "k", "args.quantity"),
    ("place_order", {"symbol": "A", "side": "buy", "quantity": True}, "k", "args.quantity"),
    ("cancel_order", {}, "k", "args.order_id"),
    ("invoke_tool", {"tool": "nope"}, "k", "args.tool"),
    ("invoke_tool", {"tool": "echo", "args": {}}, "k", "args.args"),
    ("create_deployment", [], "k", "args"),
])
def test_invalid_commands_are_refused_before_anything_is_recorded(project, kind, args, key, field):
    with pytest.raises(ValidationFailed) as invalid:
        command_execute(project=project, kind=kind, args=args, idempotency_key=key)
    assert field in invalid.value.errors
    assert CommandRecord.objects.count() == 0 and command_events() == []


def test_invoke_tool_runs_the_tool_with_the_command_key(project):
    outcome = command_execute(project=project, kind="invoke_tool", idempotency_key="t1",
                              args={"tool": "echo", "args": {"text": "hi"}})
    assert outcome.result == {"text": "hi"}
    assert command_execute(project=project, kind="invoke_tool", idempotency_key="t1",
                           args={"tool": "echo", "args": {"text": "hi"}}).replayed is True
    with pytest.raises(CommandConflict):
        command_execute(project=project, kind="invoke_tool", idempotency_key="t1",
                        args={"tool": "echo", "args": {"text": "bye"}})


def test_invoke_tool_hands_its_key_to_the_tool_and_runs_it_once(project, tool):
    seen = []
    tool("remember", lambda args, ctx: seen.append((ctx.idempotency_key, ctx.attempt)) or {"n": len(seen)})
    for _ in range(3):
        outcome = command_execute(project=project, kind="invoke_tool", idempotency_key="t-key",
                                  args={"tool": "remember", "args": {}})
    assert seen == [("t-key", 1)] and outcome.result == {"n": 1}


def test_a_retryable_tool_failure_is_tried_again_with_the_next_attempt(project):
    args = {"tool": "fail", "args": {"mode": "retryable", "times": 1}}
    with pytest.raises(CommandFailed) as failed:
        command_execute(project=project, kind="invoke_tool", idempotency_key="f1", args=args)
    assert failed.value.retryable is True and failed.value.reason == "drill_retryable"
    outcome = command_execute(project=project, kind="invoke_tool", idempotency_key="f1", args=args)
    assert outcome.result == {"attempt": 2} and outcome.command.attempts == 2


def test_a_fatal_tool_failure_is_final(project):
    args = {"tool": "fail", "args": {"mode": "fatal"}}
    for _ in range(2):
        with pytest.raises(CommandFailed) as failed:
            command_execute(project=project, kind="invoke_tool", idempotency_key="f1", args=args)
        assert failed.value.retryable is False and failed.value.reason == "drill_fatal"
    assert CommandRecord.objects.get().attempts == 1


def test_a_cancelled_tool_leaves_its_command_replayable(project):
    args = {"tool": "sleep", "args": {"seconds": 5}}
    with pytest.raises(JobCancelled):
        command_execute(project=project, kind="invoke_tool", idempotency_key="s1", args=args,
                        should_stop=lambda: True)
    record = CommandRecord.objects.get()
    assert (record.status, record.attempts, record.error) == (CommandStatus.RECORDED, 1, "")
    assert command_events() == ["command_recorded"]


def test_an_operator_command_is_audited(project, django_user_model):
    operator = django_user_model.objects.create_user(username="op")
    command_execute(project=project, kind="create_deployment", args={"name": "web"}, idempotency_key="k",
                    actor=operator)
    audit = AuditRecord.objects.get(action="command_execute")
    assert audit.actor == operator and audit.after["idempotencyKey"] == "k"
    assert CommandRecord.objects.get().actor_label == "op"


def test_command_execute_refuses_to_run_inside_a_transaction(project):
    from django.db import transaction

    with pytest.raises(RuntimeError, match="durable"):
        with transaction.atomic():
            deploy(project)


# --- the ``command`` job ------------------------------------------------------------------

def test_a_command_job_runs_in_its_project_lane(project):
    job = job_enqueue(job_type="command", project=project, payload={
        "command": "create_deployment", "args": {"name": "web"}, "idempotency_key": "job-deploy"}).job
    assert job.lane == f"project:{project.pk}"
    job = run_next()
    assert job.state == JobState.COMPLETED
    assert job.result["command"] == "create_deployment" and job.result["idempotencyKey"] == "job-deploy"
    assert job.result["replayed"] is False
    assert job.result["result"]["id"] == Deployment.objects.get(idempotency_key="job-deploy").pk


def test_a_command_job_replays_a_command_already_done(project):
    first = deploy(project, key="k")
    job_enqueue(job_type="command", project=project, payload={
        "command": "create_deployment", "args": {"name": "web"}, "idempotency_key": "k"})
    job = run_next()
    assert job.state == JobState.COMPLETED and job.result["replayed"] is True
    assert job.result["result"] == first.result and calls() == 1


def test_a_tool_job_defaults_its_key_to_the_job(project):
    job = job_enqueue(job_type="command", project=project, payload={"tool": "echo", "args": {"text": "hi"}}).job
    job = run_next()
    assert job.state == JobState.COMPLETED
    assert job.result["result"] == {"text": "hi"}
    assert job.result["command"] == "invoke_tool" and job.result["idempotencyKey"] == f"job:{job.pk}"
    assert CommandRecord.objects.get().idempotency_key == f"job:{job.pk}"


def test_a_conflicting_command_job_fails_at_once(project):
    deploy(project, key="k", name="web")
    job_enqueue(job_type="command", project=project, payload={
        "command": "create_deployment", "args": {"name": "api"}, "idempotency_key": "k"})
    job = run_next()
    assert (job.state, job.reason, job.attempts) == (JobState.FAILED, JobReason.FATAL, 1)
    assert "CommandConflict" in job.error


def test_a_command_job_retried_after_a_lost_answer_makes_one_deployment(project, crashing_adapter):
    job = job_enqueue(job_type="command", project=project, payload={
        "command": "create_deployment", "args": {"name": "web"}, "idempotency_key": "k"}).job
    job = run_next()
    assert (job.state, job.reason) == (JobState.AWAITING_TOOL, JobReason.RETRY_SCHEDULED)
    job = run_next(now=timezone.now() + timedelta(minutes=1))
    assert job.state == JobState.COMPLETED and job.attempts == 2
    assert Deployment.objects.count() == 1 and calls("create_deployment") == 2
    assert CommandRecord.objects.get().attempts == 2


def test_a_fatal_adapter_failure_fails_the_job(project):
    job_enqueue(job_type="command", project=project, payload={
        "command": "stop_deployment", "args": {"deployment_id": 12345}, "idempotency_key": "k"})
    job = run_next()
    assert (job.state, job.reason) == (JobState.FAILED, JobReason.FATAL)
    assert "CommandFailed" in job.error


@pytest.mark.parametrize("payload, field", [
    ({"command": "create_deployment", "args": {"name": "web"}}, "payload.idempotency_key"),
    ({"command": "create_deployment", "args": {"name": "web"}, "idempotency_key": ""}, "payload.idempotency_key"),
    ({"command": "launch", "args": {}, "idempotency_key": "k"}, "payload.command"),
    ({"command": "create_deployment", "args": {}, "idempotency_key": "k"}, "payload.args.name"),
    ({"command": "create_deployment", "args": "web", "idempotency_key": "k"}, "payload.args"),
    ({"tool": "nope", "args": {}}, "payload.tool"),
    ({"tool": "echo", "args": {"text": 3}}, "payload.args"),
    ({"tool": "echo", "args": {"text": "hi"}, "idempotency_key": 5}, "payload.idempotency_key"),
    ({"tool": "echo", "command": "create_deployment", "args": {}}, "payload"),
    ({"args": {}}, "payload"),
    ({"tool": "echo", "args": {"text": "hi"}, "extra": 1}, "payload.extra"),
])
def test_command_job_payloads_are_validated_at_enqueue(project, payload, field):
    with pytest.raises(ValidationFailed) as invalid:
        job_enqueue(job_type="command", project=project, payload=payload)
    assert field in invalid.value.errors, invalid.value.errors
    assert Job.objects.count() == 0


def test_a_persisted_invalid_command_payload_is_terminalized(project):
    job = job_enqueue(job_type="command", project=project, payload={"tool": "echo", "args": {"text": "hi"}}).job
    Job.objects.filter(pk=job.pk).update(payload={"command": "launch_rocket", "idempotency_key": "k"})
    job = run_next()
    assert (job.state, job.reason) == (JobState.FAILED, JobReason.INVALID_PAYLOAD)
    assert CommandRecord.objects.count() == 0


# --- billing of command jobs --------------------------------------------------------------

def command_charges(organization_id):
    return list(LedgerEntry.objects.filter(organization_id=organization_id, kind="charge")
                .values_list("amount", "source", "run_id", "idempotency_key"))


def balance_of(organization_id):
    return account_balance(organization_id=organization_id)


def test_a_command_job_tool_is_charged_once_across_replays(project):
    payload = {"command": "invoke_tool", "args": {"tool": "echo", "args": {"text": "hi"}}, "idempotency_key": "k"}
    before = balance_of(project.organization_id)["balance"]
    for _ in range(2):
        job_enqueue(job_type="command", project=project, payload=payload)
        job = run_next()
        assert job.state == JobState.COMPLETED and job.result["result"] == {"text": "hi"}
    assert job.result["replayed"] is True
    record = CommandRecord.objects.get()
    assert command_charges(project.organization_id) == [(1, "direct", None, f"command:{record.pk}")]
    assert balance_of(project.organization_id) == {"organization": project.organization_id, "balance": before - 1,
                                                   "reserved": 0, "available": before - 1}
    assert Event.objects.filter(type="ledger_charge", project_id=project.pk).count() == 1
    assert invariants_check() == []


def test_a_tool_job_is_charged_its_tool_cost_and_a_retry_is_not_charged_again(org_factory):
    organization, project, _ = org_factory(credits=3)
    job_enqueue(job_type="command", project=project, payload={"tool": "deploy", "args": {"name": "web"}})
    assert run_next().state == JobState.COMPLETED
    assert balance_of(organization.pk)["balance"] == 1  # deploy costs 2
    # 1 credit left: the fail tool (cost 1) fails retryably once, its retry runs unpaid-for again.
    job_enqueue(job_type="command", project=project, payload={"tool": "fail", "args": {"mode": "retryable"}})
    job = run_next()
    assert (job.state, job.reason) == (JobState.AWAITING_TOOL, JobReason.RETRY_SCHEDULED)
    assert balance_of(organization.pk)["balance"] == 0
    job = run_next(now=timezone.now() + timedelta(minutes=1))
    assert job.state == JobState.COMPLETED and job.result["result"] == {"attempt": 2}
    assert [amount for amount, *_ in command_charges(organization.pk)] == [2, 1]
    assert balance_of(organization.pk)["balance"] == 0
    assert invariants_check() == []


def test_a_command_job_the_organization_cannot_pay_for_fails_without_running(org_factory, tool):
    organization, project, _ = org_factory(credits=0)
    called = []
    tool("counted", lambda args, ctx: called.append(ctx.idempotency_key) or {"ok": True})
    job_enqueue(job_type="command", project=project, payload={"tool": "counted", "args": {}})
    job_enqueue(job_type="command", project=project, payload={
        "command": "invoke_tool", "args": {"tool": "counted", "args": {}}, "idempotency_key": "named"})
    for _ in range(2):
        job = run_next()
        assert (job.state, job.reason, job.attempts) == (JobState.FAILED, JobReason.INSUFFICIENT_CREDITS, 1)
        assert "InsufficientCredits" in job.error
    assert called == []
    assert CommandRecord.objects.count() == 0 and command_events() == []
    assert command_charges(organization.pk) == []
    assert balance_of(organization.pk)["balance"] == 0
    # Once topped up, the same command runs and is charged.
    account_topup(organization_id=organization.pk, amount=1, reason="top up")
    job_enqueue(job_type="command", project=project, payload={
        "command": "invoke_tool", "args": {"tool": "counted", "args": {}}, "idempotency_key": "named"})
    assert run_next().state == JobState.COMPLETED
    assert called == ["named"] and balance_of(organization.pk)["balance"] == 0
    assert invariants_check() == []


def test_credits_running_out_stop_the_next_command_job(org_factory, tool):
    organization, project, _ = org_factory(credits=1)
    called = []
    tool("counted", lambda args, ctx: called.append(ctx.idempotency_key) or {"ok": True})
    first = job_enqueue(job_type="command", project=project, payload={"tool": "counted", "args": {}}).job
    job_enqueue(job_type="command", project=project, payload={"tool": "counted", "args": {}})
    assert run_next().state == JobState.COMPLETED
    job = run_next()
    assert (job.state, job.reason) == (JobState.FAILED, JobReason.INSUFFICIENT_CREDITS)
    assert called == [f"job:{first.pk}"]
    assert balance_of(organization.pk)["available"] == 0 and invariants_check() == []


def test_adapter_commands_and_run_steps_are_not_charged_directly(project):
    job_enqueue(job_type="command", project=project, payload={
        "command": "create_deployment", "args": {"name": "web"}, "idempotency_key": "d"})
    assert run_next().state == JobState.COMPLETED
    command_execute(project=project, kind="invoke_tool", args={"tool": "echo", "args": {"text": "x"}},
                    idempotency_key="a-step-attempt")
    assert command_charges(project.organization_id) == []


# --- concurrency (PostgreSQL) -------------------------------------------------------------

@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_executions_of_one_command_make_one_deployment(project):
    barrier = threading.Barrier(8)
    results, errors = [], []

    def execute():
        try:
            barrier.wait()
            results.append(deploy(project, key="race").result)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=execute) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert Deployment.objects.count() == 1 and CommandRecord.objects.count() == 1
    assert len({result["id"] for result in results}) == 1 and len(results) == 8
    assert CommandRecord.objects.get().status == CommandStatus.SUCCEEDED
