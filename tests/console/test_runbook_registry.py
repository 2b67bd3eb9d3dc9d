"""A runbook is declared once: every registered runbook is an admin action on its model's list, a
button on the pages of the objects it applies to, a management command and a permission of the
Operators group. The checks iterate the registry, so a new runbook is checked without a new test."""

from __future__ import annotations

from dataclasses import replace

import pytest
from django.contrib.auth.models import Group, Permission
from django.core.exceptions import ImproperlyConfigured
from django.core.management import get_commands, load_command_class
from django.core.management.sql import emit_post_migrate_signal
from django.urls import reverse

from core import runbooks as registry
from core.models import Project
from core.runbooks import OPERATORS_GROUP, Plan, Runbook, runbook_register
from core.services import project_create
from jobs.models import Job
from jobs.services import queue_pause
from runs.models import EscalationTicket, Run
from tests.console.test_actions import action_choices
from tests.console.test_gates_console import gated_run, manifest  # noqa: F401  (manifest: a fixture)

pytestmark = pytest.mark.django_db

RUN_STATES = ("created", "pending", "running", "paused", "failed", "completed", "awaiting_approval")


@pytest.fixture
def objects(run_in, escalation, job_in, project, manifest, settings):  # noqa: F811
    """Objects of every model that has runbooks, in the states their runbooks act on."""
    settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S = 0  # a running run is stuck at once: recover applies
    return {
        Run: [run_in(state) for state in RUN_STATES] + [gated_run(project, manifest, "stopped_drift")],
        EscalationTicket: [escalation()],
        Job: [job_in("executing"), job_in("queued")],
        Project: [project, paused_project(project)],
    }


def paused_project(project) -> Project:
    paused = project_create(organization=project.organization, name="paused")
    queue_pause(project_id=paused.pk, actor=None, reason="a paused queue for its resume button")
    return paused


def test_every_registered_runbook_is_an_action_a_button_a_command_and_an_operators_permission(
        operator_client, objects):
    assert len(registry.RUNBOOKS) >= 17
    operators = Group.objects.get(name=OPERATORS_GROUP)
    commands = get_commands()
    buttons = {}  # (model, pk) → the buttons on the object's page
    for model, found in objects.items():
        for obj in found:
            page = operator_client.get(reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_change",
                                               args=[obj.pk]))
            assert page.status_code == 200
            buttons[model, obj.pk] = ({button["name"] for button in page.context["runbook_buttons"]},
                                      page.content.decode())

    for label, runbook in registry.RUNBOOKS.items():
        model = runbook.model
        assert model in objects, f"{label}: build objects of {model._meta.label} in the fixture above"
        assert runbook.name in action_choices(operator_client, model._meta.label_lower), label

        shown_on = [obj for obj in objects[model] if runbook.name in buttons[model, obj.pk][0]]
        if runbook.button:
            assert shown_on, f"{label}: no object's page offers it"
        else:
            assert not shown_on, label
        for obj in shown_on:
            assert runbook.button_shows_on(obj), (label, obj)
            assert f'href="{runbook.admin_url(obj.pk)}"' in buttons[model, obj.pk][1]

        assert runbook.command in commands, f"{label}: no command {runbook.command!r}"
        assert load_command_class(commands[runbook.command], runbook.command).runbook is runbook

        app_label, codename = runbook.permission.split(".")
        permission = Permission.objects.get(content_type__app_label=app_label, codename=codename)
        assert permission.name == runbook.permission_label
        assert operators.permissions.filter(pk=permission.pk).exists(), f"{label}: not in the Operators group"


def test_buttons_show_only_on_the_declared_states(make_staff, login, run_in):
    client = login(make_staff("op", "runs.start_run", "runs.recover_run"))
    for state in ("created", "pending", "running", "paused"):
        run = run_in(state)
        page = client.get(reverse("admin:runs_run_change", args=[run.pk]))
        names = {button["name"] for button in page.context["runbook_buttons"]}
        assert ("start" in names) is (state == "created"), (state, names)
        assert "recover" not in names  # a running run with a fresh heartbeat is not stuck


def _probe(**changes) -> Runbook:
    fields = dict(name="probe", title="Probe", permission="runs.probe_run", permission_label="Can probe a run",
                  plan=lambda run, options: Plan(current=run.status, change="nothing"),
                  perform=lambda run, **kwargs: "probed", model=Run, noun="run", command="probe_run")
    return Runbook(**{**fields, **changes})


def test_a_new_runbook_gets_its_permission_and_the_operators_group_after_migrate(monkeypatch, operator_client,
                                                                                run_in):
    monkeypatch.setattr(registry, "RUNBOOKS", dict(registry.RUNBOOKS))
    probe = runbook_register(_probe())
    operators = Group.objects.get(name=OPERATORS_GROUP)
    held = operators.permissions.count()
    assert not Permission.objects.filter(codename="probe_run").exists()

    emit_post_migrate_signal(verbosity=0, interactive=False, db="default")
    permission = Permission.objects.get(content_type__app_label="runs", codename="probe_run")
    assert permission.name == "Can probe a run"
    assert operators.permissions.count() == held + 1 and operators.permissions.filter(pk=permission.pk).exists()
    emit_post_migrate_signal(verbosity=0, interactive=False, db="default")  # again: nothing more
    assert Permission.objects.filter(codename="probe_run").count() == 1 and operators.permissions.count() == held + 1

    registry.RUNBOOKS[probe.label] = replace(probe, permission_label="Can probe runs")  # relabelled
    emit_post_migrate_signal(verbosity=0, interactive=False, db="default")
    assert Permission.objects.get(pk=permission.pk).name == "Can probe runs"

    assert "probe" in action_choices(operator_client)  # the admin offers it at once
    run = run_in("running")
    page = operator_client.get(reverse("admin:runs_run_change", args=[run.pk]))
    assert "probe" in {button["name"] for button in page.context["runbook_buttons"]}


def test_the_operators_group_is_made_again_when_it_is_missing(monkeypatch):
    Group.objects.filter(name=OPERATORS_GROUP).delete()
    emit_post_migrate_signal(verbosity=0, interactive=False, db="default")
    granted = {f"{perm.content_type.app_label}.{perm.codename}"
               for perm in Group.objects.get(name=OPERATORS_GROUP).permissions.all()}
    assert granted == {runbook.permission for runbook in registry.RUNBOOKS.values()}


@pytest.mark.parametrize("changes, message", [
    ({"command": "cancel_run", "name": "probe"}, "command 'cancel_run' belongs to runbook runs.run.cancel"),
    ({"name": "cancel", "command": "probe_run"}, "runbook runs.run.cancel is registered twice"),
    ({"permission": "runs.cancel_run", "permission_label": "Can cancel"},
     "permission 'runs.cancel_run' has two labels"),
    ({"model": None}, "needs a model, a command and a permission label"),
    ({"command": ""}, "needs a model, a command and a permission label"),
])
def test_a_conflicting_declaration_is_refused_at_start_up(monkeypatch, changes, message):
    monkeypatch.setattr(registry, "RUNBOOKS", dict(registry.RUNBOOKS))
    before = dict(registry.RUNBOOKS)
    with pytest.raises(ImproperlyConfigured, match=message.replace("(", r"\(").replace(")", r"\)")):
        runbook_register(_probe(**changes))
    assert registry.RUNBOOKS == before
    same = registry.RUNBOOKS["runs.run.cancel"]
    assert runbook_register(same) is same and registry.RUNBOOKS == before  # registering again: a no-op


def test_a_permission_of_another_app_needs_its_model(monkeypatch):
    monkeypatch.setattr(registry, "RUNBOOKS", dict(registry.RUNBOOKS))
    runbook_register(_probe(permission="billing.probe_run"))
    with pytest.raises(ImproperlyConfigured, match="set permission_model"):
        emit_post_migrate_signal(verbosity=0, interactive=False, db="default")


def test_a_runbook_of_another_model_is_no_action_or_button_here(operator_client, run_in, job_in):
    run, job = run_in("running"), job_in("executing")
    assert "requeue" not in action_choices(operator_client)
    assert operator_client.get(reverse("admin:runs_run_runbook", args=[run.pk, "requeue"])).status_code == 403
    assert operator_client.get(reverse("admin:jobs_job_runbook", args=[job.pk, "force_fail"])).status_code == 403
    assert operator_client.get(reverse("admin:runs_run_runbook", args=[run.pk, "no_such"])).status_code == 403
    response = operator_client.post(reverse("admin:runs_run_changelist"),
                                    {"action": "requeue", "_selected_action": [run.pk], "index": "0"}, follow=True)
    assert [message.message for message in response.context["messages"]] == ["No action selected."]
    assert Run.objects.get(pk=run.pk).status == "running" and Job.objects.get(pk=job.pk).state == "executing"
