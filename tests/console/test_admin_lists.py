"""The console's lists: every model an operator needs, read-only (delete off for ledger, events
and audit), with the filters and searches an incident needs."""

from __future__ import annotations

import pytest
from django.db import transaction
from django.urls import reverse

from billing.models import LedgerEntry
from core.models import AuditRecord, Event
from runs import services
from runs.models import Run
from tests.conftest import make_plan
from tests.console.conftest import build_run

pytestmark = pytest.mark.django_db

MODELS = [
    "core.organization", "core.project", "core.membership", "core.event", "core.auditrecord",
    "billing.creditaccount", "billing.ledgerentry",
    "jobs.job", "jobs.commandrecord", "jobs.deployment", "jobs.order", "jobs.adaptercall", "jobs.workersession",
    "jobs.workerheartbeat", "jobs.joblane", "jobs.maintenancemark",
    "runs.run", "runs.runattempt", "runs.agent", "runs.task", "runs.step", "runs.stepattempt", "runs.artifact",
    "runs.escalationticket", "runs.approvalrequest",
]


def changelist(model: str) -> str:
    app_label, model_name = model.split(".")
    return reverse(f"admin:{app_label}_{model_name}_changelist")


def listed_ids(response) -> set[int]:
    return {obj.pk for obj in response.context["cl"].result_list}


@pytest.fixture(scope="module")
def incident_ids(django_db_setup, django_db_blocker):
    """A little of everything, built once for the module through the services (in a transaction
    rolled back at the end): runs in several states, an escalation, an approval, a job."""
    from billing.services import organization_create
    from jobs.services import job_claim, job_enqueue
    from runs.services import escalations

    with django_db_blocker.unblock(), transaction.atomic():
        _, project, _, _ = organization_create(name="incident", owner_username="incident-owner", credits=1_000)
        runs = {state: build_run(project, state).pk for state in ("created", "pending", "running", "paused", "failed",
                                                                  "completed", "awaiting_approval")}
        escalations.escalation_open(run=Run.objects.get(pk=runs["running"]), trigger="manual", detail="needs a look")
        job_enqueue(job_type="noop", project=project, payload={})
        job_claim(worker="incident")
        yield runs
        transaction.set_rollback(True)


@pytest.fixture
def incident(incident_ids, db):
    return {state: Run.objects.get(pk=pk) for state, pk in incident_ids.items()}


@pytest.mark.parametrize("model", MODELS)
def test_every_model_lists_searches_and_refuses_add_for_an_operator(operator_client, incident, model):
    url = changelist(model)
    assert operator_client.get(url).status_code == 200
    assert operator_client.get(url, {"q": "1"}).status_code == 200
    assert operator_client.get(url, {"q": "abc"}).status_code == 200
    app_label, model_name = model.split(".")
    assert operator_client.get(reverse(f"admin:{app_label}_{model_name}_add")).status_code == 403


@pytest.mark.parametrize("model", ["billing.ledgerentry", "core.event", "core.auditrecord", "runs.run"])
def test_delete_is_off_even_for_a_superuser(login, django_user_model, incident, model):
    root = login(django_user_model.objects.create_user(username="root", is_staff=True, is_superuser=True))
    app_label, model_name = model.split(".")
    model_class = {"billing.ledgerentry": LedgerEntry, "core.event": Event, "core.auditrecord": AuditRecord,
                   "runs.run": Run}[model]
    obj = model_class.objects.order_by("pk").first()
    response = root.get(changelist(model))
    action_form = response.context["action_form"]
    assert action_form is None or "delete_selected" not in dict(action_form.fields["action"].choices)
    before = model_class.objects.count()
    assert root.post(reverse(f"admin:{app_label}_{model_name}_delete", args=[obj.pk])).status_code == 403
    root.post(changelist(model), {"action": "delete_selected", "_selected_action": [obj.pk], "post": "yes"})
    assert model_class.objects.count() == before


def test_status_fields_are_read_only(login, django_user_model, incident):
    root = login(django_user_model.objects.create_user(username="root", is_staff=True, is_superuser=True))
    run = incident["running"]
    change = reverse("admin:runs_run_change", args=[run.pk])
    page = root.get(change)
    assert page.status_code == 200
    assert not page.context["adminform"].form.fields  # nothing editable: every field is shown read-only
    assert root.post(change, {"status": "completed", "name": "x"}).status_code == 403
    assert Run.objects.get(pk=run.pk).status == "running"


def test_run_filters_status_project_organization_priority_error_and_time(viewer_client, org_factory, incident):
    other_org, other_project, _ = org_factory(credits=100)
    elsewhere = build_run(other_project, "created", name="elsewhere")
    urgent = services.run_create(project=incident["created"].project, name="urgent", plan=make_plan(), priority=5)
    url = changelist("runs.run")
    assert listed_ids(viewer_client.get(url, {"status__exact": "failed"})) == {incident["failed"].pk}
    assert listed_ids(viewer_client.get(url, {"organization__id__exact": other_org.pk})) == {elsewhere.pk}
    assert listed_ids(viewer_client.get(url, {"project__id__exact": other_project.pk})) == {elsewhere.pk}
    assert listed_ids(viewer_client.get(url, {"priority_band": "high"})) == {urgent.pk}
    assert urgent.pk not in listed_ids(viewer_client.get(url, {"priority_band": "normal"}))
    response = viewer_client.get(url, {"last_error_code": "worker_lost"})
    assert listed_ids(response) == {incident["failed"].pk}
    assert b"worker_lost (1)" in viewer_client.get(url).content  # offered in the sidebar with its count
    assert len(listed_ids(viewer_client.get(url, {"status_changed_at_within": "15m"}))) == Run.objects.count()
    since_2000 = {"created_at__gte": "2000-01-01T00:00:00+00:00"}
    assert len(listed_ids(viewer_client.get(url, since_2000))) == Run.objects.count()
    assert listed_ids(viewer_client.get(url, {"q": "elsewhere"})) == {elsewhere.pk}


def test_run_filter_escalated(viewer_client, incident, escalation):
    url = changelist("runs.run")
    assert listed_ids(viewer_client.get(url, {"escalated": "yes"})) == {incident["running"].pk}
    assert incident["running"].pk not in listed_ids(viewer_client.get(url, {"escalated": "no"}))
    page = viewer_client.get(url)
    row = next(obj for obj in page.context["cl"].result_list if obj.pk == incident["running"].pk)
    assert row.has_open_escalation is True


def test_run_filter_stuck_uses_the_timeouts_from_settings(viewer_client, incident, settings):
    url = changelist("runs.run")
    assert listed_ids(viewer_client.get(url, {"stuck": "yes"})) == set()
    settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S = 0  # every running run is silent now
    assert listed_ids(viewer_client.get(url, {"stuck": "yes"})) == {incident["running"].pk}
    settings.ORCHESTRATOR_RUN_PENDING_TIMEOUT_S = 0
    settings.ORCHESTRATOR_RUN_PAUSED_TIMEOUT_S = 0
    stuck = listed_ids(viewer_client.get(url, {"stuck": "yes"}))
    assert stuck == {incident["running"].pk, incident["pending"].pk, incident["paused"].pk,
                     incident["awaiting_approval"].pk}
    assert listed_ids(viewer_client.get(url, {"stuck": "no"})) & stuck == set()


def test_the_stuck_list_is_counted_by_its_parts_with_the_other_filters(viewer_client, incident, settings):
    url = changelist("runs.run")
    settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S = 0
    settings.ORCHESTRATOR_RUN_PENDING_TIMEOUT_S = 0
    settings.ORCHESTRATOR_RUN_PAUSED_TIMEOUT_S = 0
    whole = viewer_client.get(url, {"stuck": "yes"}).context["cl"]
    assert whole.result_count == len(whole.result_list) == 4 and whole.paginator.count_label == "4"
    paused = viewer_client.get(url, {"stuck": "yes", "status__exact": "paused"}).context["cl"]
    assert paused.result_count == len(paused.result_list) == 2  # the filters beside "stuck" count too
    named = viewer_client.get(url, {"stuck": "yes", "q": incident["running"].name}).context["cl"]
    assert named.result_count == len(named.result_list) >= 1  # and the search
    settings.ORCHESTRATOR_ADMIN_COUNT_LIMIT = 3
    bounded = viewer_client.get(url, {"stuck": "yes"}).context["cl"]
    assert bounded.paginator.count_label == "3+" and len(bounded.result_list) == 4
