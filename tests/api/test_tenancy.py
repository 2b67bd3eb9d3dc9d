"""Every endpoint × another organization's ids answers 404, and lists never leak."""

from __future__ import annotations

import pytest

from core.models import Event
from jobs.models import Job
from runs.services import escalations
from runs.models import Run
from tests.api.conftest import assert_error, create_run

pytestmark = pytest.mark.django_db


@pytest.fixture
def theirs(other, django_capture_on_commit_callbacks):
    """Objects of another organization: a started run (with its tick job), an escalation, a job."""
    run = create_run(other)
    with django_capture_on_commit_callbacks(execute=True):
        other.client.post(f"/api/v1/runs/{run['id']}/start/", format="json")
    ticket, _ = escalations.escalation_open(run=Run.objects.get(pk=run["id"]), trigger="manual", detail="drill")
    job = other.client.post("/api/v1/jobs/", {"type": "noop", "project": other.project.pk, "payload": {}},
                            format="json").json()
    ledger = other.client.get("/api/v1/ledger/").json()["results"][0]
    return {"run": run["id"], "job": job["jobId"], "escalation": ticket.pk, "ledger": ledger["id"],
            "organization": other.organization.pk, "project": other.project.pk}


DETAIL_GETS = [
    "/api/v1/runs/{run}/", "/api/v1/runs/{run}/events/", "/api/v1/jobs/{job}/", "/api/v1/escalations/{escalation}/",
    "/api/v1/ledger/{ledger}/", "/api/v1/organizations/{organization}/", "/api/v1/organizations/{organization}/balance/",
    "/api/v1/projects/{project}/",
]
ACTION_POSTS = [
    ("/api/v1/runs/{run}/start/", {}), ("/api/v1/runs/{run}/cancel/", {}), ("/api/v1/runs/{run}/pause/", {}),
    ("/api/v1/runs/{run}/resume/", {}), ("/api/v1/runs/{run}/retry/", {}),
    ("/api/v1/runs/{run}/approve/", {"gate": "g", "approval_ref": "r"}), ("/api/v1/jobs/{job}/cancel/", {}),
    ("/api/v1/escalations/{escalation}/acknowledge/", {}),
    ("/api/v1/escalations/{escalation}/resolve/", {"reason": "done"}),
    ("/api/v1/runs/", {"project": "{project}", "name": "x", "plan": {"agents": []}}),
    ("/api/v1/jobs/", {"type": "noop", "project": "{project}", "payload": {}}),
]
LIST_FILTERS = [
    "/api/v1/runs/?project={project}", "/api/v1/jobs/?project={project}", "/api/v1/ledger/?run={run}",
    "/api/v1/ledger/?organization={organization}", "/api/v1/escalations/?run={run}",
    "/api/v1/projects/?organization={organization}", "/api/v1/events/?run={run}", "/api/v1/events/?project={project}",
    "/api/v1/events/?organization={organization}",
]


def _fill(template, ids):
    if isinstance(template, str):
        text = template.format(**ids)
        return int(text) if template.startswith("{") and text.isdigit() else text
    if isinstance(template, dict):
        return {key: _fill(value, ids) for key, value in template.items()}
    return template


def test_every_detail_of_another_organization_is_404(tenant, theirs):
    for template in DETAIL_GETS:
        assert_error(tenant.client.get(template.format(**theirs)), 404, "not_found")
    assert_error(tenant.client.delete(f"/api/v1/runs/{theirs['run']}/"), 404, "not_found")


def test_every_action_on_another_organizations_object_is_404_and_changes_nothing(tenant, theirs):
    before = (Run.objects.get(pk=theirs["run"]).status, Job.objects.count(), Run.objects.count(), Event.objects.count())
    for template, body in ACTION_POSTS:
        path = template.format(**theirs)
        assert_error(tenant.client.post(path, _fill(body, theirs), format="json"), 404, "not_found")
        # with an Idempotency-Key too: no key is stored for another organization
        assert_error(tenant.client.post(path, _fill(body, theirs), format="json", HTTP_IDEMPOTENCY_KEY="k"), 404,
                     "not_found")
    after = (Run.objects.get(pk=theirs["run"]).status, Job.objects.count(), Run.objects.count(), Event.objects.count())
    assert before == after


def test_every_list_filter_naming_another_organization_is_404(tenant, theirs):
    for template in LIST_FILTERS:
        assert_error(tenant.client.get(template.format(**theirs)), 404, "not_found")


def test_a_missing_id_and_another_organizations_id_answer_the_same(tenant, theirs):
    missing = tenant.client.get("/api/v1/runs/999999/").json()
    foreign = tenant.client.get(f"/api/v1/runs/{theirs['run']}/").json()
    assert missing["code"] == foreign["code"] == "not_found"
    assert missing["detail"].replace("999999", "N") == foreign["detail"].replace(str(theirs["run"]), "N")


def test_lists_show_only_the_callers_organizations(tenant, theirs):
    mine = create_run(tenant)
    for path, key, expected in [
        ("/api/v1/runs/", "id", {mine["id"]}),
        ("/api/v1/jobs/", "jobId", set()),
        ("/api/v1/escalations/", "id", set()),
        ("/api/v1/organizations/", "id", {tenant.organization.pk}),
        ("/api/v1/projects/", "id", {tenant.project.pk}),
    ]:
        rows = tenant.client.get(path).json()["results"]
        assert {row[key] for row in rows} == expected, path
    ledger = tenant.client.get("/api/v1/ledger/").json()["results"]
    assert {row["organization"] for row in ledger} == {tenant.organization.pk}
    events = tenant.client.get("/api/v1/events/?limit=500").json()["results"]
    assert events and {event["organization"] for event in events} == {tenant.organization.pk}
