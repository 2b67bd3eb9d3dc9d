"""``suggest_action``: an operator asks for the next action on a run (admin button or API, wait-or-202),
one job per run at a time; the suggestion is computed from the run and read as stale once it changed."""

from __future__ import annotations

import re
import threading

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse

from billing.selectors import account_balance
from core.models import Event
from diagnosis.analysis import suggestion_compute
from diagnosis.models import Suggestion
from diagnosis.services import suggestion_request
from jobs.models import Job, JobState
from runs import services
from runs.pipeline import gates
from runs.models import Run
from tests.diagnosis.conftest import current_step, drill, echo, one_task_plan, running_run
from tests.drive import drain_jobs

pytestmark = pytest.mark.django_db


def suggest_jobs():
    return Job.objects.filter(type="suggest_action")


def drain_suggestions():
    drain_jobs(until=lambda: not suggest_jobs().exclude(state__in=["completed", "failed", "cancelled"]).exists())


def created_run(project, **options) -> Run:
    return services.run_create(project=project, name="asked about", plan=one_task_plan(echo("s0")), **options)


# --- what is suggested --------------------------------------------------------------------------

def test_a_failed_run_with_a_retryable_error_and_attempts_left_is_retried(project, fail_step):
    run = running_run(project, one_task_plan(drill("s0"), bystander=True))
    for _ in range(3):
        fail_step(run, "s0")
    run.refresh_from_db()
    assert run.status == Run.Status.FAILED
    available = account_balance(organization_id=project.organization_id)["available"]
    result = suggestion_compute(run_id=run.pk)
    assert result.action == "retry"
    assert result.text == f"retry: retryable error drill_retryable, 2 attempt(s) left, {available} credits available"
    assert result.facts["last_error"]["retryable"] is True and result.facts["attempts_left"] == 2
    assert result.facts["runbook"]["command"] == f'python manage.py retry_run {run.pk} --reason "..."'


def test_each_state_gets_its_own_computed_action(project, org_factory, fail_step, clock):
    completed = running_run(project, one_task_plan(echo("s0")))
    attempt = services.step_begin(step_id=current_step(completed.pk, "s0").pk)
    services.step_attempt_succeed(attempt_id=attempt.pk, output={})
    result = suggestion_compute(run_id=completed.pk)
    assert (result.action, result.text) == ("none", "nothing to do: run completed (1 credits charged, 2 released)")

    gated = running_run(project, {"agents": [{"name": "a0", "tasks": [{"name": "t0", "steps": [
        {"name": "gate", "kind": "approval", "gate": "publish"}]}]}]})
    step = current_step(gated.pk, "gate")
    gates.gate_execute(step=step, attempt=services.step_begin(step_id=step.pk))
    clock.advance(seconds=30)
    result = suggestion_compute(run_id=gated.pk)
    assert (result.action, result.text) == ("approve_gate", "approve gate publish: the run waits for it, waiting 30 s")
    assert "--gate publish" in result.facts["runbook"]["command"]

    silent = running_run(project, one_task_plan(echo("s0")))
    clock.advance(seconds=412)
    result = suggestion_compute(run_id=silent.pk)
    assert (result.action, result.text) == ("recover", "recover stuck run: heartbeat silent 412 s (timeout 60 s)")

    broken = running_run(project, one_task_plan(drill("s0", mode="fatal")), max_attempts=1)
    fail_step(broken, "s0", code="unknown_tool", message="tool 'nope' is not registered", retryable=False)
    result = suggestion_compute(run_id=broken.pk)
    assert (result.action, result.text) == ("refund", "refund: 1 credits charged for failed attempts (unknown_tool)")
    assert result.facts["runbook"]["command"] == f'python manage.py refund_run {broken.pk} --amount 1 --reason "..."'

    poor_org, poor_project, _ = org_factory(credits=2)
    poor = services.run_create(project=poor_project, name="poor", plan=one_task_plan(echo("s0")), credit_limit=2)
    services.run_create(project=poor_project, name="other", plan=one_task_plan(echo("s0")), credit_limit=2)
    services.run_start(run_id=poor.pk)
    other = Run.objects.get(project=poor_project, name="other")
    result = suggestion_compute(run_id=other.pk)
    assert (result.action, result.text) == ("topup", "top up credits: starting needs 2 credits, only 0 available")
    assert result.facts["runbook"]["command"].startswith(f"python manage.py topup_credits {poor_org.pk} --amount 2")


def test_spent_attempts_escalate_then_wait_for_the_ticket(project, fail_step):
    run = running_run(project, one_task_plan(drill("s0", mode="fatal"), bystander=True), max_attempts=1)
    fail_step(run, "s0", code="drill_fatal", retryable=False)
    result = suggestion_compute(run_id=run.pk)
    assert (result.action, result.text) == (
        "escalate", "escalate: drill_fatal (permanent tool error (drill)), attempts exhausted (1 of 1)")
    from runs.services import escalations

    ticket, _ = escalations.escalation_open(run=Run.objects.get(pk=run.pk), trigger="manual", detail="look")
    result = suggestion_compute(run_id=run.pk)
    assert (result.action, result.text) == ("acknowledge", f"acknowledge escalation: escalation {ticket.pk} (manual) "
                                                           f"is open")
    escalations.escalation_acknowledge(ticket_id=ticket.pk, actor=None)
    result = suggestion_compute(run_id=run.pk)
    assert result.action == "wait" and f"escalation {ticket.pk} (manual) is acknowledged" in result.text


# --- single flight, events, stale -------------------------------------------------------------------

def test_asking_twice_while_it_runs_returns_the_same_job(project, operator):
    run = created_run(project)
    first = suggestion_request(run_id=run.pk, actor=operator)
    again = suggestion_request(run_id=run.pk, actor=operator)
    assert (first.dedupe, again.dedupe) == ("enqueued", "already_queued")
    assert again.job.pk == first.job.pk and again.suggestion.pk == first.suggestion.pk
    assert suggest_jobs().count() == 1 and Suggestion.objects.count() == 1
    job = first.job
    assert (job.priority_class, job.run_id, job.state) == ("interactive", run.pk, JobState.QUEUED)

    drain_suggestions()
    suggestion = Suggestion.objects.get()
    assert (suggestion.status, suggestion.action) == ("ready", "start")
    assert suggestion.text == "start: never started; 3 credits to reserve, 1000 available"
    events = list(Event.objects.filter(run_id=run.pk, type="diagnosis_suggestion").order_by("id"))
    assert [event.payload["suggestion"]["status"] for event in events] == ["pending", "ready"]
    assert events[-1].payload["suggestion"]["text"] == suggestion.text

    later = suggestion_request(run_id=run.pk, actor=operator)  # done: a new request is a new job
    assert later.dedupe == "enqueued" and later.job.pk != job.pk
    assert suggest_jobs().count() == 2


def test_a_suggestion_is_stale_once_the_run_changed(project, operator, make_staff, login):
    run = created_run(project)
    suggestion_request(run_id=run.pk, actor=operator)
    drain_suggestions()
    api = _owner_client(project)
    body = api.get(f"/api/v1/runs/{run.pk}/suggest/").json()["suggestion"]
    assert (body["stale"], body["run_status_at_request"], body["run_status"]) == (False, "created", "created")
    page = reverse("admin:runs_run_change", args=[run.pk])
    viewer = login(make_staff("viewer"))
    assert 'data-stale="false"' in viewer.get(page).content.decode()

    services.run_start(run_id=run.pk)
    body = api.get(f"/api/v1/runs/{run.pk}/suggest/").json()["suggestion"]
    assert (body["stale"], body["run_status_at_request"], body["run_status"]) == (True, "created", "pending")
    html = viewer.get(page).content.decode()
    assert 'data-stale="true"' in html
    assert "stale: the run changed after the request" in html


def test_a_failed_job_leaves_a_failed_suggestion(project, operator, monkeypatch, django_capture_on_commit_callbacks):
    from diagnosis import analysis

    def broken(**kwargs):
        raise ValueError("cannot read the run")

    monkeypatch.setattr(analysis, "suggestion_compute", broken)
    run = created_run(project)
    requested = suggestion_request(run_id=run.pk, actor=operator)
    with django_capture_on_commit_callbacks(execute=True):
        drain_suggestions()
    suggestion = Suggestion.objects.get(pk=requested.suggestion.pk)
    assert suggestion.status == "failed"
    assert suggestion.text == (f"no suggestion: job {requested.job.pk} failed (fatal_error: ValueError: cannot read "
                               f"the run)")


# --- the API ------------------------------------------------------------------------------------------

def _owner_client(project):
    from rest_framework.test import APIClient

    client = APIClient()
    client.force_authenticate(project.organization.memberships.get().user)
    return client


def test_post_answers_202_with_a_location_then_the_job_carries_the_suggestion(tenant_factory):
    organization, project, owner, client = tenant_factory()
    run = created_run(project)
    url = f"/api/v1/runs/{run.pk}/suggest/"
    response = client.post(url, format="json")
    assert response.status_code == 202, response.content
    body = response.json()
    job_id = body["job"]["jobId"]
    assert response["Location"] == f"/api/v1/jobs/{job_id}/"
    assert (body["status"], body["dedupe"], body["suggestion"]["status"]) == ("queued", "enqueued", "pending")
    assert body["suggestion"]["requested_by"] == owner.username
    again = client.post(url, format="json")
    assert again.status_code == 202
    assert (again.json()["dedupe"], again.json()["job"]["jobId"]) == ("already_queued", job_id)

    drain_suggestions()
    job = client.get(response["Location"]).json()
    assert job["state"] == "completed" and job["result"]["action"] == "start"
    latest = client.get(url).json()["suggestion"]
    assert (latest["status"], latest["action"], latest["job"]) == ("ready", "start", job_id)
    assert latest["text"].startswith("start: never started")
    # The run's event feed (its API timeline) carries the suggestion as it changed.
    events = client.get(f"/api/v1/runs/{run.pk}/events/").json()["results"]
    shown = [event["suggestion"]["status"] for event in events if event["type"] == "diagnosis_suggestion"]
    assert shown == ["pending", "ready"]


def test_wait_is_validated_and_capped(tenant_factory, settings):
    _, project, _, client = tenant_factory()
    run = created_run(project)
    url = f"/api/v1/runs/{run.pk}/suggest/"
    for bad in ("soon", "-1", "99999"):
        response = client.post(f"{url}?wait={bad}", format="json")
        assert response.status_code == 400 and response.json()["code"] == "validation_error", bad
        assert "wait" in response.json()["errors"]
    assert not suggest_jobs().exists()
    settings.ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS = 30
    response = client.post(f"{url}?wait=600", format="json")  # capped at 30 ms: nobody runs it meanwhile
    assert response.status_code == 202 and response.json()["status"] == "queued"


@pytest.mark.django_db(transaction=True)
def test_wait_answers_200_with_the_suggestion_when_a_worker_finishes_in_time(tenant_factory, settings):
    settings.ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS = 10_000
    _, project, _, client = tenant_factory()
    run = created_run(project)
    errors: list[BaseException] = []

    def worker():
        try:
            drain_jobs(until=lambda: suggest_jobs().filter(state="completed").exists(), timeout=10, worker="thread")
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        response = client.post(f"/api/v1/runs/{run.pk}/suggest/?wait=8", format="json")
    finally:
        thread.join(15)
    assert not errors
    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["status"], body["job"]["state"], body["suggestion"]["status"]) == ("completed", "completed", "ready")
    assert body["suggestion"]["action"] == "start" and body["suggestion"]["stale"] is False
    assert "Location" not in response


def test_another_organizations_run_is_404_and_no_credentials_401(tenant_factory):
    _, project, _, client = tenant_factory()
    _, their_project, _, _ = tenant_factory()
    theirs = created_run(their_project)
    for method, path in (("post", "suggest"), ("get", "suggest"), ("get", "explanations")):
        response = getattr(client, method)(f"/api/v1/runs/{theirs.pk}/{path}/", format="json")
        assert response.status_code == 404 and response.json()["code"] == "not_found", (method, path)
        response = getattr(client, method)(f"/api/v1/runs/987654321/{path}/", format="json")
        assert response.status_code == 404, (method, path)
    assert not suggest_jobs().exists()
    from rest_framework.test import APIClient

    anonymous = APIClient().post(f"/api/v1/runs/{created_run(project).pk}/suggest/", format="json")
    assert anonymous.status_code == 401 and anonymous.json()["code"] == "not_authenticated"


def test_a_session_post_needs_its_csrf_token(tenant_factory):
    _, project, owner, _ = tenant_factory()
    run = created_run(project)
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(owner)
    response = browser.post(f"/api/v1/runs/{run.pk}/suggest/", content_type="application/json")
    assert response.status_code == 403 and response.json()["code"] == "permission_denied"
    assert not suggest_jobs().exists()


# --- the admin button ----------------------------------------------------------------------------------

def test_the_button_is_hidden_and_refused_without_the_permission(project, make_staff, login):
    run = created_run(project)
    page = reverse("admin:runs_run_change", args=[run.pk])
    suggest = reverse("admin:runs_run_suggest", args=[run.pk])
    viewer = login(make_staff("viewer"))
    html = viewer.get(page).content.decode()
    assert 'id="diagnosis"' in html and "nothing asked yet" in html
    assert suggest not in html and "Suggest next action" not in html
    assert viewer.post(suggest).status_code == 403
    assert not suggest_jobs().exists()


def test_the_button_asks_once_per_flight_and_the_page_shows_the_answer(project, make_staff, login):
    run = created_run(project)
    page = reverse("admin:runs_run_change", args=[run.pk])
    suggest = reverse("admin:runs_run_suggest", args=[run.pk])
    operator = login(make_staff("asker", "diagnosis.request_suggestion"), enforce_csrf_checks=True)
    html = operator.get(page).content.decode()
    assert f'action="{suggest}"' in html and 'value="Suggest next action"' in html
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', html).group(1)
    assert operator.post(suggest).status_code == 403  # no CSRF token
    assert not suggest_jobs().exists()
    response = operator.post(suggest, {"csrfmiddlewaretoken": token}, follow=True)
    assert response.redirect_chain[-1][0] == page + "#diagnosis"
    job = suggest_jobs().get()
    messages = [str(message) for message in response.context["messages"]]
    assert messages == [f"Suggest next action: asked (job {job.pk}); the suggestion appears below when it is ready."]
    response = operator.post(suggest, {"csrfmiddlewaretoken": token}, follow=True)
    assert [str(m) for m in response.context["messages"]] == [
        f"Suggest next action: already being worked on (job {job.pk})."]
    assert suggest_jobs().count() == 1
    assert "working on it" in response.content.decode()
    assert operator.get(suggest).status_code == 405

    drain_suggestions()
    html = operator.get(page).content.decode()
    suggestion = Suggestion.objects.get()
    assert suggestion.text in html and 'data-status="ready"' in html
    assert "asked by asker" in html
