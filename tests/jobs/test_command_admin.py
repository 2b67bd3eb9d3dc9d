"""The jobs admin: read-only lists an operator can filter and search during an incident."""

from __future__ import annotations

import warnings

import pytest
from django.urls import reverse

from jobs.commands.services import command_execute
from jobs.executor import job_run_claimed
from jobs.services import job_claim, job_enqueue
from jobs.sessions import session_preflight_register

MODELS = ["job", "commandrecord", "deployment", "order", "adaptercall", "workersession", "workerheartbeat"]


@pytest.fixture
def admin_client(client, django_user_model):
    """A logged-in superuser without password hashing (fast)."""
    client.force_login(django_user_model.objects.create_user(username="root", is_staff=True, is_superuser=True))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="No directory at", category=UserWarning)  # static not collected
        yield client


@pytest.fixture
def populated(project, monkeypatch):
    from jobs import sessions

    monkeypatch.setattr(sessions, "_PREFLIGHTS", dict(sessions._PREFLIGHTS))
    session_preflight_register("tester", lambda session, job: None)
    deployment = command_execute(project=project, kind="create_deployment", args={"name": "web"},
                                 idempotency_key="d1").result
    command_execute(project=project, kind="place_order", idempotency_key="o1",
                    args={"symbol": "ABC", "side": "buy", "quantity": 2, "deployment_id": deployment["id"]})
    job_enqueue(job_type="command", project=project, payload={"tool": "echo", "args": {"text": "hi"}})
    job = job_claim(worker="test")
    job_run_claimed(job, worker="test")
    sessions.worker_session_prepare(owner=f"project:{project.pk}", agent="tester", project_id=project.pk)
    return project


@pytest.mark.parametrize("model", MODELS)
def test_changelists_render_and_search(admin_client, populated, model):
    url = reverse(f"admin:jobs_{model}_changelist")
    assert admin_client.get(url).status_code == 200
    assert admin_client.get(url, {"q": "abc"}).status_code == 200
    assert admin_client.get(url, {"q": "1"}).status_code == 200
    assert admin_client.get(reverse(f"admin:jobs_{model}_add")).status_code == 403


def test_job_list_filters(admin_client, populated):
    url = reverse("admin:jobs_job_changelist")
    for params in ({"state": "completed"}, {"type": "command"}, {"priority_class": "background"},
                   {"reason": "completed"}, {"project__id__exact": populated.pk}):
        response = admin_client.get(url, params)
        assert response.status_code == 200 and b"command" in response.content


def test_rows_are_read_only(admin_client, populated):
    from jobs.models import CommandRecord

    record = CommandRecord.objects.first()
    change = reverse("admin:jobs_commandrecord_change", args=[record.pk])
    assert admin_client.get(change).status_code == 200  # viewable
    assert admin_client.post(change, {"status": "failed"}).status_code == 403
    assert admin_client.post(reverse("admin:jobs_commandrecord_delete", args=[record.pk])).status_code == 403
    record.refresh_from_db()
    assert record.status == "succeeded"
