"""Runbook actions in the admin: each is hidden and refused without its own permission, asks for
confirmation and a reason, changes the state through the service, writes our audit record and
Django's log entry, reports per object, and does nothing the second time."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from django.contrib import messages
from django.contrib.admin.models import CHANGE, LogEntry
from django.urls import reverse
from django.utils.html import escape

from billing.selectors import account_balance
from core.models import AuditRecord
from jobs.models import Job
from runs.invariants import invariants_check
from runs.models import ApprovalRequest, EscalationTicket, Run

pytestmark = pytest.mark.django_db

ALL_RUN_PERMISSIONS = ["runs.start_run", "runs.force_fail_run", "runs.cancel_run", "runs.pause_run", "runs.resume_run",
                       "runs.retry_run", "billing.refund_run", "runs.escalate_run", "runs.approve_gate",
                       "runs.recover_run", "runs.void_run", "runs.acknowledge_drift"]


@dataclass(frozen=True)
class Case:
    permission: str
    start: str  # the state the run is built in (tests/console/conftest.build_run)
    end: str  # its status afterwards
    audit: str  # the AuditRecord action the service writes
    fields: dict = field(default_factory=dict)  # the action's own form fields
    repeat: str = ""  # what the repeat reports as skipped


RUN_CASES = {
    "start": Case("runs.start_run", "created", "pending", "run_start", repeat="already started (pending)"),
    "force_fail": Case("runs.force_fail_run", "running", "failed", "run_force_fail", repeat="already failed"),
    "cancel": Case("runs.cancel_run", "running", "cancelled", "run_cancel", repeat="already cancelled"),
    "pause": Case("runs.pause_run", "running", "paused", "run_pause", repeat="already paused"),
    "resume": Case("runs.resume_run", "paused", "resuming", "run_resume", repeat="already resuming"),
    "retry": Case("runs.retry_run", "failed", "retrying", "run_retry", repeat="already retrying"),
    "refund": Case("billing.refund_run", "completed", "completed", "run_refund", fields={"key": "k1"},
                   repeat="nothing charged left to refund"),
    "escalate": Case("runs.escalate_run", "running", "running", "run_escalate", fields={"severity": "critical"},
                     repeat="already escalated"),
    "approve_gate": Case("runs.approve_gate", "awaiting_approval", "resuming", "approve_gate",
                         fields={"gate": "publish", "approval_ref": "CHG-1"}, repeat="already approved"),
    "void": Case("runs.void_run", "paused", "cancelled", "run_void", repeat="already voided"),
    "recover": Case("runs.recover_run", "running", "failed", "run_recover", fields={"older_than_s": "0"},
                    repeat="not running (failed)"),
}


def changelist(model: str = "runs.run") -> str:
    app_label, model_name = model.split(".")
    return reverse(f"admin:{app_label}_{model_name}_changelist")


def act(client, action: str, objects, *, model: str = "runs.run", confirm: bool = True, **fields):
    """POST an admin action on ``objects``: the changelist's form, or (``confirm``) the confirmation page's.
    A redirect is followed, so the page shows (and uses up) the messages of this action."""
    data = {"action": action, "_selected_action": [obj.pk for obj in objects]}
    if confirm:
        data.update({"runbook_confirm": action, **fields})
    else:
        data["index"] = "0"
    return client.post(changelist(model), data, follow=True)


def redirected(response) -> bool:
    return bool(response.redirect_chain) and response.redirect_chain[-1][1] == 302


def reported(response) -> list[tuple[int, str]]:
    return [(message.level, message.message) for message in response.context["messages"]]


def action_choices(client, model: str = "runs.run") -> set[str]:
    form = client.get(changelist(model)).context["action_form"]
    return set() if form is None else {name for name, _ in form.fields["action"].choices if name}


@pytest.mark.parametrize("action", list(RUN_CASES))
def test_without_its_permission_the_action_is_hidden_and_refused(make_staff, login, run_in, action):
    case = RUN_CASES[action]
    others = [perm for perm in ALL_RUN_PERMISSIONS if perm != case.permission]
    client = login(make_staff("almost", *others))
    run = run_in(case.start)
    assert action not in action_choices(client)
    audits, before = AuditRecord.objects.count(), Run.objects.filter(pk=run.pk).values().get()

    response = act(client, action, [run], reason="should not happen", **case.fields)
    assert redirected(response)
    assert reported(response) == [(messages.WARNING, "No action selected.")]
    runbook_url = reverse("admin:runs_run_runbook", args=[run.pk, action])
    assert client.get(runbook_url).status_code == 403
    assert client.post(runbook_url, {"runbook_confirm": action, "reason": "no", **case.fields}).status_code == 403
    assert Run.objects.filter(pk=run.pk).values().get() == before
    assert AuditRecord.objects.count() == audits and not LogEntry.objects.exists()


def test_a_view_only_user_gets_no_actions_at_all(viewer_client, run_in):
    run_in("running")
    assert action_choices(viewer_client) == set()


@pytest.mark.parametrize("action", list(RUN_CASES))
def test_the_action_confirms_then_requires_a_reason(make_staff, login, run_in, action, settings):
    settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S = 0
    case = RUN_CASES[action]
    client = login(make_staff("op", case.permission))
    run = run_in(case.start)
    assert action in action_choices(client)

    page = act(client, action, [run], confirm=False)
    assert page.status_code == 200
    assert [t.name for t in page.templates][0] == "admin/runbook_confirm.html"
    html = page.content.decode()
    assert escape(str(run)) in html and "Credits at stake" in html and 'name="reason"' in html
    row = page.context["rows"][0]
    assert (row["object"].pk, row["plan"].skip) == (run.pk, "")
    assert row["plan"].change and row["plan"].credits

    blank = act(client, action, [run], reason="   ", **case.fields)
    assert not redirected(blank) and "A reason is required." in blank.content.decode()
    assert Run.objects.get(pk=run.pk).status == run.status
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize("action", list(RUN_CASES))
def test_the_action_changes_state_audits_logs_and_is_idempotent(make_staff, login, run_in, action, settings):
    settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S = 3600  # the plan of "recover" uses the form's threshold
    case = RUN_CASES[action]
    user = make_staff("op", case.permission)
    client = login(user)
    run = run_in(case.start)

    response = act(client, action, [run], reason=f"incident 42: {action}", **case.fields)
    assert redirected(response)
    (level, message), = reported(response)
    assert level == messages.SUCCESS and f"run {run.pk}" in message and ": done: " in message, message
    run.refresh_from_db()
    assert run.status == case.end
    audit = AuditRecord.objects.filter(action=case.audit, run_id=run.pk).get()
    assert (audit.actor_id, audit.actor_label, audit.reason) == (user.pk, "op", f"incident 42: {action}")
    entry = LogEntry.objects.get()
    assert (entry.user_id, entry.object_id, entry.action_flag) == (user.pk, str(run.pk), CHANGE)
    assert f"incident 42: {action}" in entry.change_message

    again = act(client, action, [run], reason="clicked twice", **case.fields)
    (level, message), = reported(again)
    assert level == messages.WARNING and ": skipped: " in message and case.repeat in message, message
    assert Run.objects.get(pk=run.pk).status == case.end
    assert AuditRecord.objects.filter(action=case.audit, run_id=run.pk).count() == 1
    assert LogEntry.objects.count() == 1
    assert invariants_check() == []


def test_bulk_force_fail_reports_each_run(make_staff, login, run_in):
    client = login(make_staff("op", "runs.force_fail_run"))
    running, pending, completed, paused = (run_in(state) for state in ("running", "pending", "completed", "paused"))
    page = act(client, "force_fail", [running, pending, completed, paused], confirm=False)
    plans = {row["object"].pk: row["plan"] for row in page.context["rows"]}
    assert plans[completed.pk].skip == "already ended (completed)"
    assert plans[paused.pk].refusal == "not allowed from paused"
    assert (page.context["to_do"], page.context["to_refuse"], page.context["to_skip"]) == (2, 1, 1)
    assert "will probably be refused: not allowed from paused" in page.content.decode()

    response = act(client, "force_fail", [running, pending, completed, paused], reason="bad deploy")
    report = reported(response)
    assert [level for level, _ in report] == [messages.SUCCESS, messages.SUCCESS, messages.WARNING, messages.ERROR]
    assert f"run {completed.pk}" in report[2][1] and "skipped: already ended (completed)" in report[2][1]
    assert f"run {paused.pk}" in report[3][1]
    assert f"refused: invalid_transition: run {paused.pk} is paused; cannot fail" in report[3][1]
    statuses = dict(Run.objects.filter(pk__in=[running.pk, pending.pk, completed.pk, paused.pk])
                    .values_list("pk", "status"))
    assert statuses == {running.pk: "failed", pending.pk: "failed", completed.pk: "completed", paused.pk: "paused"}
    assert set(LogEntry.objects.values_list("object_id", flat=True)) == {str(running.pk), str(pending.pk)}
    assert Run.objects.get(pk=running.pk).last_error_code == "force_failed"
    assert invariants_check() == []


def test_refund_partial_and_never_more_than_charged(make_staff, login, run_in):
    client = login(make_staff("op", "billing.refund_run"))
    run = run_in("completed")
    charged = run.credits_charged
    assert charged == 3
    balance = account_balance(organization_id=run.organization_id)["balance"]
    page = act(client, "refund", [run], confirm=False)
    assert page.context["rows"][0]["plan"].credits == "refunds 3 of 3 charged credits"

    too_much = act(client, "refund", [run], reason="goodwill", amount="4", key="a")
    (level, message), = reported(too_much)
    assert level == messages.ERROR and "cannot refund 4: only 3 charged" in message
    act(client, "refund", [run], reason="goodwill", amount="1", key="b")
    act(client, "refund", [run], reason="goodwill", amount="1", key="b")  # the same confirmation again
    run.refresh_from_db()
    assert (run.credits_charged, run.credits_refunded - (run.credits_reserved - charged)) == (2, 1)
    assert account_balance(organization_id=run.organization_id)["balance"] == balance + 1
    refused = act(client, "refund", [run_in("running")], reason="not yet", amount="1", key="c")
    assert "only completed, failed or cancelled runs can be refunded" in reported(refused)[0][1]
    assert invariants_check() == []


def test_approve_gate_prefills_the_gate_and_refuses_a_reused_reference(make_staff, login, run_in):
    client = login(make_staff("op", "runs.approve_gate"))
    first, second = run_in("awaiting_approval"), run_in("awaiting_approval")
    page = act(client, "approve_gate", [first, second], confirm=False)
    assert page.context["form"]["gate"].value() == "publish"
    response = act(client, "approve_gate", [first, second], reason="CAB approved", gate="publish",
                   approval_ref="CHG-7")
    levels = [level for level, _ in reported(response)]
    assert levels == [messages.SUCCESS, messages.ERROR]
    assert "approval_reused" in reported(response)[1][1]
    assert ApprovalRequest.objects.get(run=first).approval_ref == "CHG-7"
    assert Run.objects.get(pk=second.pk).status_reason == "awaiting_approval:publish"
    missing = act(client, "approve_gate", [second], reason="CAB approved", gate="publish", approval_ref="")
    assert not redirected(missing) and "This field is required." in missing.content.decode()


def test_recover_fails_only_silent_running_runs_and_refunds(make_staff, login, run_in, settings):
    client = login(make_staff("op", "runs.recover_run"))
    running, paused = run_in("running"), run_in("paused")
    held = running.credits_reserved - running.credits_charged - running.credits_refunded
    fresh = act(client, "recover", [running, paused], reason="worker died", older_than_s="3600")
    assert [level for level, _ in reported(fresh)] == [messages.WARNING, messages.WARNING]
    assert "not stuck" in reported(fresh)[0][1] and "not running (paused)" in reported(fresh)[1][1]

    response = act(client, "recover", [running], reason="worker died", older_than_s="0")
    assert reported(response)[0][0] == messages.SUCCESS
    running.refresh_from_db()
    assert (running.status, running.last_error_code) == ("failed", "heartbeat_timeout")
    assert running.credits_refunded == held and not running.agents.filter(status__in=["running", "pending"]).exists()
    assert invariants_check() == []


def test_a_heartbeat_arriving_after_the_confirmation_page_saves_the_run(run_in, operator):
    from datetime import timedelta

    from django.utils import timezone

    from core.runbooks import runbook_execute, runbook_plan
    from runs import runbooks, services

    running = run_in("running")
    Run.objects.filter(pk=running.pk).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    plan = runbook_plan(runbooks.RUN_RECOVER, Run.objects.get(pk=running.pk), {"older_than_s": 60})
    assert not plan.skip and not plan.refusal  # what the operator confirms: stuck for 5 minutes
    assert services.run_heartbeat(run_id=running.pk)  # the worker comes back meanwhile
    [outcome] = runbook_execute(runbooks.RUN_RECOVER, [running], actor=operator, reason="worker died",
                                options={"older_than_s": 60})
    assert (outcome.result, outcome.detail.startswith("not stuck")) == ("skipped", True), outcome
    with pytest.raises(services.RunNotStuck) as refused:
        services.run_recover(run_id=running.pk, older_than_s=60, actor=operator, reason="worker died")
    assert refused.value.code == "run_not_stuck"
    assert Run.objects.get(pk=running.pk).status == "running"
    assert not AuditRecord.objects.filter(action="run_recover").exists()


def test_the_run_page_offers_buttons_for_what_applies(make_staff, login, run_in):
    user = make_staff("op", "runs.force_fail_run", "runs.resume_run", "runs.pause_run")
    client = login(user)
    run = run_in("running")
    page = client.get(reverse("admin:runs_run_change", args=[run.pk]))
    buttons = {button["name"] for button in page.context["runbook_buttons"]}
    assert buttons == {"force_fail", "pause"}  # resume would do nothing to a running run
    url = reverse("admin:runs_run_runbook", args=[run.pk, "pause"])
    assert f'href="{url}"' in page.content.decode()

    confirm = client.get(url)
    assert confirm.status_code == 200 and [row["object"].pk for row in confirm.context["rows"]] == [run.pk]
    done = client.post(url, {"runbook_confirm": "pause", "reason": "hold on"})
    assert done.status_code == 302 and done.url == reverse("admin:runs_run_change", args=[run.pk])
    assert Run.objects.get(pk=run.pk).status == "paused"
    assert LogEntry.objects.get().user_id == user.pk
    assert client.get(reverse("admin:runs_run_runbook", args=[run.pk, "retry"])).status_code == 403
    assert client.get(reverse("admin:runs_run_runbook", args=[999999, "pause"])).status_code == 404


def test_the_page_of_a_created_run_offers_start(make_staff, login, run_in):
    client = login(make_staff("op", "runs.start_run", "runs.cancel_run"))
    run = run_in("created")
    page = client.get(reverse("admin:runs_run_change", args=[run.pk]))
    assert {button["name"] for button in page.context["runbook_buttons"]} == {"start", "cancel"}
    url = reverse("admin:runs_run_runbook", args=[run.pk, "start"])
    assert f'href="{url}"' in page.content.decode()

    confirm = client.get(url)
    assert confirm.status_code == 200 and [row["object"].pk for row in confirm.context["rows"]] == [run.pk]
    done = client.post(url, {"runbook_confirm": "start", "reason": "customer asked"})
    assert done.status_code == 302 and done.url == reverse("admin:runs_run_change", args=[run.pk])
    assert Run.objects.get(pk=run.pk).status == "pending"
    assert AuditRecord.objects.get(action="run_start", run_id=run.pk).reason == "customer asked"
    started = client.get(reverse("admin:runs_run_change", args=[run.pk]))
    assert "start" not in {button["name"] for button in started.context["runbook_buttons"]}


# --- escalations ------------------------------------------------------------------------------

def test_escalation_acknowledge_and_resolve(make_staff, login, escalation):
    ticket = escalation()
    assert {"acknowledge", "resolve"} & action_choices(login(make_staff("nobody")),
                                                       "runs.escalationticket") == set()
    user = make_staff("op", "runs.manage_escalation")
    client = login(user)
    assert action_choices(client, "runs.escalationticket") == {"acknowledge", "resolve"}

    acknowledged = act(client, "acknowledge", [ticket], model="runs.escalationticket", reason="looking")
    assert reported(acknowledged)[0][0] == messages.SUCCESS
    again = act(client, "acknowledge", [ticket], model="runs.escalationticket", reason="looking")
    assert reported(again) == [(messages.WARNING, f"Acknowledge — escalation ticket {ticket.pk}: "
                                                  "skipped: already acknowledged")]
    blank = act(client, "resolve", [ticket], model="runs.escalationticket", reason="")
    assert not redirected(blank) and "A resolution is required." in blank.content.decode()
    act(client, "resolve", [ticket], model="runs.escalationticket", reason="restarted the worker")
    ticket = EscalationTicket.objects.get(pk=ticket.pk)
    assert (ticket.status, ticket.resolution, ticket.acknowledged_by_id, ticket.resolved_by_id) == (
        "resolved", "restarted the worker", user.pk, user.pk)
    assert list(AuditRecord.objects.filter(target_type="escalation").order_by("id").values_list("action", "reason")) \
        == [("escalation_acknowledge", "looking"), ("escalation_resolve", "restarted the worker")]
    assert LogEntry.objects.count() == 2
    repeat = act(client, "resolve", [ticket], model="runs.escalationticket", reason="again")
    assert "skipped: already resolved" in reported(repeat)[0][1]


# --- jobs -------------------------------------------------------------------------------------

def test_job_requeue_fail_and_cancel(make_staff, login, job_in):
    executing, queued = job_in("executing"), job_in("queued")
    assert action_choices(login(make_staff("nobody")), "jobs.job") == set()
    user = make_staff("op", "jobs.requeue_job", "jobs.fail_job", "jobs.cancel_job")
    client = login(user)
    assert action_choices(client, "jobs.job") == {"requeue", "fail", "cancel"}

    page = act(client, "requeue", [executing, queued], model="jobs.job", confirm=False)
    assert [row["plan"].skip for row in page.context["rows"]] == ["", "already waiting (queued)"]
    response = act(client, "requeue", [executing, queued], model="jobs.job", reason="worker wedged")
    assert [level for level, _ in reported(response)] == [messages.SUCCESS, messages.WARNING]
    assert Job.objects.get(pk=executing.pk).state == "awaiting_tool"

    act(client, "fail", [executing], model="jobs.job", reason="poison message")
    failed = Job.objects.get(pk=executing.pk)
    assert (failed.state, failed.reason) == ("failed", "fatal_error") and "poison message" in failed.error
    again = act(client, "fail", [executing], model="jobs.job", reason="poison message")
    assert "skipped: already ended (failed)" in reported(again)[0][1]

    act(client, "cancel", [queued], model="jobs.job", reason="not needed")
    assert Job.objects.get(pk=queued.pk).state == "cancelled"
    assert list(AuditRecord.objects.filter(target_type="job").order_by("id").values_list("action", "actor_id")) == [
        ("job_requeue", user.pk), ("job_fail", user.pk), ("job_cancel", user.pk)]
    assert LogEntry.objects.count() == 3


@pytest.mark.parametrize("model, action, kind, allowed", [
    ("jobs.job", "requeue", "executing", ["jobs.fail_job", "jobs.cancel_job"]),
    ("jobs.job", "fail", "executing", ["jobs.requeue_job", "jobs.cancel_job"]),
    ("jobs.job", "cancel", "queued", ["jobs.requeue_job", "jobs.fail_job"]),
    ("runs.escalationticket", "acknowledge", "ticket", []),
    ("runs.escalationticket", "resolve", "ticket", []),
])
def test_a_job_or_ticket_action_posted_without_its_permission_changes_nothing(make_staff, login, job_in, escalation,
                                                                              model, action, kind, allowed):
    target = escalation() if kind == "ticket" else job_in(kind)
    client = login(make_staff("almost", *allowed))
    before = type(target).objects.filter(pk=target.pk).values().get()
    response = act(client, action, [target], model=model, reason="should not happen")
    assert response.status_code == 200
    if allowed:  # the changelist has other actions: the POST names one it does not offer
        assert redirected(response) and reported(response) == [(messages.WARNING, "No action selected.")]
    else:  # no action at all: the POST is an ordinary look at the list
        assert response.context["action_form"] is None
    assert type(target).objects.filter(pk=target.pk).values().get() == before
    assert not AuditRecord.objects.filter(target_type__in=["job", "escalation"]).exists()
    assert not LogEntry.objects.exists()


# --- the Operators group ----------------------------------------------------------------------

def test_operators_may_run_every_runbook(operator_client, run_in, escalation, job_in):
    assert action_choices(operator_client) == set(RUN_CASES) | {"acknowledge_drift"}  # its own tests need drift
    assert action_choices(operator_client, "runs.escalationticket") == {"acknowledge", "resolve"}
    assert action_choices(operator_client, "jobs.job") == {"requeue", "fail", "cancel"}
    run = run_in("running")
    act(operator_client, "force_fail", [run], reason="operator drill")
    assert Run.objects.get(pk=run.pk).status == "failed"
    assert AuditRecord.objects.get(action="run_force_fail").actor_label == "operator-1"


def test_a_large_selection_is_summed_up_and_a_huge_one_refused(make_staff, login, run_in, project):
    client = login(make_staff("op", "runs.cancel_run"))
    template = run_in("created")
    created = Run.objects.bulk_create([  # created is the default state: no transition is skipped
        Run(organization_id=template.organization_id, project=project, name=f"bulk {index}", plan=template.plan,
            credit_limit=template.credit_limit, status_changed_at=template.status_changed_at)
        for index in range(500)
    ])
    ids = [template.pk, *(run.pk for run in created)]
    huge = client.post(changelist(), {"action": "cancel", "_selected_action": [template.pk], "select_across": "1",
                                      "index": "0"}, follow=True)  # "select all 501 runs"
    # beyond the page cap, "select all" asks to confirm a bulk operation (tests/console/test_bulk_runbooks.py)
    assert huge.context["bulk_total"] == 501 and reported(huge) == []
    assert not Run.objects.filter(status="cancelled").exists()

    response = act(client, "cancel", Run.objects.filter(pk__in=ids[:30]), reason="cleanup")
    report = reported(response)
    assert len(report) == 26 and all(level == messages.SUCCESS for level, _ in report)
    assert report[-1][1] == "Cancel — 5 more done: " + ", ".join(str(pk) for pk in sorted(ids[:30])[25:])
    assert Run.objects.filter(status="cancelled").count() == 30 and LogEntry.objects.count() == 30


def test_the_retry_runbook_takes_an_edited_plan_and_shows_its_errors_in_the_form(make_staff, login, run_in):
    client = login(make_staff("op", "runs.retry_run"))
    run = run_in("failed")
    url = reverse("admin:runs_run_runbook", args=[run.pk, "retry"])
    assert 'name="plan"' in client.get(url).content.decode()
    for text, message in (("{nope", "not valid JSON"), ('{"agents": []}', "agents")):
        page = client.post(url, {"runbook_confirm": "retry", "reason": "edit", "plan": text})
        assert page.status_code == 200 and message in str(page.context["form"].errors["plan"])
        assert Run.objects.get(pk=run.pk).status == "failed"
    edited = {"agents": [{"name": "a", "tasks": [{"name": "t", "steps": [
        {"name": "s", "tool": "echo", "args": {"text": "edited"}}]}]}]}
    done = client.post(url, {"runbook_confirm": "retry", "reason": "edit", "plan": json.dumps(edited)})
    assert done.status_code == 302
    run.refresh_from_db()
    assert (run.status, run.plan) == ("retrying", edited)
    assert AuditRecord.objects.get(action="run_retry", run_id=run.pk).after["plan"] == edited
