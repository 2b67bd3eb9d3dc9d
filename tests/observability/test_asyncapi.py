"""The AsyncAPI 3.0 document of ``/ws/events/``: valid against the official schema, served next
to the OpenAPI schema, and true to the wire: the frames of a real connection and every event a
real run, job, ledger and escalation write match their message's payload schema."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jsonschema
import pytest
import yaml
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.db import transaction
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7
from rest_framework.test import APIClient

from core.asyncapi import asyncapi_document, event_types
from core.models import Event
from core.relay import EVENT_FIELDS, envelope

SPECS_VERSION = "6.11.1"
SPECS_PREFIX = Path(os.environ.get("ASYNCAPI_SPECS_PREFIX", "/tmp/asyncapi"))
SPECS_INSTALL = f"npm install --prefix {SPECS_PREFIX} @asyncapi/specs@{SPECS_VERSION}"
SPEC_FILE = SPECS_PREFIX / "node_modules" / "@asyncapi" / "specs" / "schemas" / "3.0.0.json"
DOCUMENT_URI = "urn:orchestrator-console:asyncapi"


def wire(document: dict) -> dict:
    """The document as a client reads it (JSON types only)."""
    return json.loads(json.dumps(document))


def message_validator(document: dict, name: str) -> jsonschema.Draft7Validator:
    """A validator of ``components.messages.<name>.payload`` whose ``$ref``s resolve in the document."""
    registry = Registry().with_resource(DOCUMENT_URI, Resource(contents=document, specification=DRAFT7))
    schema = {"$ref": f"{DOCUMENT_URI}#/components/messages/{name}/payload"}
    return jsonschema.Draft7Validator(schema, registry=registry, format_checker=jsonschema.FormatChecker())


def payload_errors(document: dict, name: str, message: dict) -> list[str]:
    return [f"{'/'.join(map(str, error.absolute_path)) or '<message>'}: {error.message}"
            for error in message_validator(document, name).iter_errors(message)]


# --- the document -----------------------------------------------------------------------------

def test_the_document_is_valid_asyncapi_3_0_0():
    if not SPEC_FILE.exists():
        pytest.skip(f"the AsyncAPI JSON Schema is not installed: {SPECS_INSTALL}")
    spec = json.loads(SPEC_FILE.read_text())
    validator = jsonschema.Draft7Validator(spec)
    document = wire(asyncapi_document())
    errors = [f"{'/'.join(map(str, error.absolute_path))}: {error.message[:200]}"
              for error in validator.iter_errors(document)]
    assert errors == []
    assert document["asyncapi"] == "3.0.0"
    broken = wire(asyncapi_document())
    broken["operations"]["sendEvents"]["action"] = "publish"  # AsyncAPI 2's verb: not 3.0
    assert list(validator.iter_errors(broken)), "the official schema must refuse an AsyncAPI 2 operation"


def test_every_payload_is_a_draft_7_schema_and_every_reference_resolves():
    document = wire(asyncapi_document())
    for name, message in document["components"]["messages"].items():
        jsonschema.Draft7Validator.check_schema(message["payload"])
        message_validator(document, name).is_valid({})  # resolves every $ref it meets (raises if unresolvable)
    operations = document["operations"]
    referenced = {ref["$ref"].rsplit("/", 1)[1] for operation in operations.values() for ref in operation["messages"]}
    assert referenced == set(document["channels"]["events"]["messages"]) == set(document["components"]["messages"])


def test_every_status_of_the_models_has_its_event_message():
    from billing.models import LedgerEntry
    from jobs.models import WorkerSessionStatus
    from runs.models import EscalationTicket, NodeStatus, Run

    declared = set(event_types())
    expected = {f"run_{status}" for status in Run.Status.values}
    expected |= {f"{entity}_{status}" for entity in ("agent", "task", "step") for status in NodeStatus.values}
    expected |= {f"escalation_{status}" for status in EscalationTicket.Status.values}
    expected |= {f"ledger_{kind}" for kind in LedgerEntry.Kind.values}
    expected |= {f"worker_session_{status}" for status in WorkerSessionStatus.values}
    expected |= {f"orchestrator_job_{name}" for name in ("queued", "started", "progress", "completed", "failed",
                                                         "canceled")}
    expected |= {"escalation_updated", "run_stopped", "run_retry_refused", "run_replanned", "run_refunded",
                 "run_drift_detected", "run_drift_acknowledged", "run_deleted", "run_cap_exceeded",
                 "approval_requested", "approval_granted", "project_created", "organization_created",
                 "job_probe_executed", "diagnosis_explanation", "diagnosis_suggestion"}
    assert expected - declared == set()


@pytest.mark.django_db
def test_the_document_is_served_as_yaml_and_as_json_without_credentials():
    client = APIClient()
    as_yaml = client.get("/api/asyncapi.yaml")
    assert as_yaml.status_code == 200 and as_yaml["Content-Type"].startswith("application/yaml")
    assert yaml.safe_load(as_yaml.content) == wire(asyncapi_document())
    as_json = client.get("/api/schema/asyncapi/")
    assert as_json.status_code == 200 and as_json.json() == wire(asyncapi_document())
    refused = client.post("/api/schema/asyncapi/", {}, format="json")
    assert refused.status_code == 405 and refused.json()["code"] == "method_not_allowed"


def test_the_client_messages_take_what_the_consumer_takes():
    document = wire(asyncapi_document())
    assert payload_errors(document, "subscribe", {"action": "subscribe", "run": 12, "after": 3400}) == []
    assert payload_errors(document, "subscribe", {"action": "subscribe", "all": True}) == []
    assert payload_errors(document, "auth", {"action": "auth", "token": "abc"}) == []
    assert payload_errors(document, "unsubscribe", {"action": "unsubscribe", "project": 3}) == []
    # What the consumer answers with a bad_message error.
    assert payload_errors(document, "subscribe", {"action": "subscribe"})
    assert payload_errors(document, "subscribe", {"action": "subscribe", "run": 1, "after": -1})
    assert payload_errors(document, "subscribe", {"action": "subscribe", "run": 1, "after": True})
    assert payload_errors(document, "subscribe", {"action": "subscribe", "run": "1"})
    assert payload_errors(document, "auth", {"action": "auth", "token": ""})


# --- the wire ---------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_the_frames_of_a_real_connection_match_their_messages(org_factory):
    from rest_framework.authtoken.models import Token

    from orchestrator_site.asgi import application

    organization, project, owner = org_factory()
    other_organization, _, _ = org_factory()
    token = Token.objects.create(user=owner).key
    document = wire(asyncapi_document())

    async def scenario():
        communicator = WebsocketCommunicator(application, "/ws/events/", headers=[(b"origin", b"http://localhost")])
        assert (await communicator.connect())[0]
        frames = []
        for message in ({"action": "auth", "token": token}, {"action": "auth", "token": token},
                        {"action": "subscribe", "organization": organization.pk, "after": 0},
                        {"action": "ping"}, {"action": "subscribe", "organization": other_organization.pk},
                        {"action": "subscribe", "run": 1, "after": "x"}, {"action": "dance"},
                        {"action": "unsubscribe", "organization": organization.pk}):
            await communicator.send_json_to(message)
            while True:
                frame = await communicator.receive_json_from(timeout=5)
                frames.append(frame)
                if "id" not in frame or frame["type"] in ("subscribed", "unsubscribed"):
                    break  # replayed events come before the frame that answers
        await communicator.disconnect()
        return frames

    frames = async_to_sync(scenario)()
    kinds = [frame["type"] for frame in frames if "ts" not in frame]
    assert kinds == ["hello", "hello", "subscribed", "pong", "error", "error", "error", "unsubscribed"]
    for frame in frames:
        name = frame["type"]
        assert payload_errors(document, name, frame) == [], frame


@pytest.mark.django_db(transaction=True)
def test_every_event_a_real_run_writes_matches_its_message(org_factory, monkeypatch):
    """A run (a step retried then passing, a failed run escalated, a cancelled, a deleted and a
    gated one), jobs (completed, cancelled, a probe), the ledger and escalations, driven through
    the services and executed in-process; every event row, in its wire form, must match the
    payload schema of its type's message, and no type may be undeclared."""
    from core.services import project_create
    from diagnosis.services import suggestion_request
    from jobs.services import job_cancel, job_enqueue
    from runs import services
    from runs.services.escalations import escalation_acknowledge, escalation_add_detail, escalation_open, escalation_resolve
    from runs.services import approval_grant
    from runs.models import EscalationTicket, Run
    from tests.drive import drain_jobs

    monkeypatch.setattr("jobs.wake._send", lambda count: None)
    organization, project, owner = org_factory()
    project_create(organization=organization, name="second", actor=owner)

    def running(plan: dict, name: str) -> Run:
        run = services.run_create(project=project, name=name, plan=plan)
        services.run_start(run_id=run.pk, actor=owner, reason="go")
        return run

    # A run whose second step fails once (retried: an explanation) and then completes.
    ok = running({"agents": [{"name": "a0", "tasks": [{"name": "t0", "steps": [
        {"name": "s0", "tool": "echo", "args": {"text": "hi"}},
        {"name": "s1", "tool": "fail", "args": {"mode": "retryable", "times": 1}}]}]}]}, "passes")
    drain_jobs(until=lambda: Run.objects.get(pk=ok.pk).status == Run.Status.COMPLETED)
    # A run that fails for good, then is escalated, updated, acknowledged and resolved.
    bad = running({"agents": [{"name": "a0", "tasks": [{"name": "t0", "steps": [
        {"name": "s0", "tool": "fail", "args": {"mode": "fatal"}}]}]}]}, "fails")
    drain_jobs(until=lambda: Run.objects.get(pk=bad.pk).status == Run.Status.FAILED)
    ticket, created = escalation_open(run=Run.objects.get(pk=bad.pk), trigger=EscalationTicket.Trigger.MANUAL,
                                      detail="look at it", actor=owner, reason="fatal")
    assert created
    with transaction.atomic():  # it runs in its caller's transaction (the cap check's)
        escalation_add_detail(ticket=ticket, detail="still failing")
    escalation_acknowledge(ticket_id=ticket.pk, actor=owner, reason="on it")
    escalation_resolve(ticket_id=ticket.pk, actor=owner, reason="fixed")
    suggestion_request(run_id=bad.pk, actor=owner)
    # A gated run that waits for an approval, then completes.
    gated = running({"agents": [{"name": "a", "tasks": [{"name": "t", "steps": [
        {"name": "hello", "tool": "echo", "args": {"text": "hi"}},
        {"name": "gate", "kind": "approval", "gate": "publish"}]}]}]}, "gated")
    drain_jobs(until=lambda: Run.objects.get(pk=gated.pk).status_reason == "awaiting_approval:publish")
    approval_grant(run_id=gated.pk, gate="publish", approval_ref="CAB-7", actor=owner, reason="ok")
    # A run cancelled while it runs, one deleted before it starts.
    cancelled = running({"agents": [{"name": "a0", "tasks": [{"name": "t0", "steps": [
        {"name": "s0", "tool": "echo", "args": {"text": "hi"}}]}]}]}, "cancelled")
    services.run_cancel(run_id=cancelled.pk, actor=owner, reason="not needed")
    services.run_delete(run_id=services.run_create(project=project, name="never", plan={"agents": [
        {"name": "a0", "tasks": [{"name": "t0", "steps": [{"name": "s0", "tool": "echo", "args": {"text": "x"}}]}]}]}).pk,
        actor=owner, reason="typo")
    # Jobs: one completed, a probe, one cancelled while queued.
    job_enqueue(job_type="noop", project=project, payload={}, actor=owner)
    job_enqueue(job_type="probe", project=project, payload={})
    drain_jobs(until=lambda: Run.objects.get(pk=gated.pk).status == Run.Status.COMPLETED)
    drain_jobs()
    queued = job_enqueue(job_type="noop", project=project, payload={"lane": "x"}).job
    job_cancel(job_id=queued.pk, actor=owner, reason="changed my mind")

    document = wire(asyncapi_document())
    declared = document["components"]["messages"]
    rows = list(Event.objects.order_by("id").values(*EVENT_FIELDS))
    undeclared = sorted({row["type"] for row in rows} - set(declared))
    assert undeclared == [], f"event types without a message in the AsyncAPI document: {undeclared}"
    mismatches = {}
    for row in rows:
        event = wire(envelope(row))
        errors = payload_errors(document, row["type"], event)
        if errors:
            mismatches.setdefault(row["type"], f"{errors} in {event}")
    assert mismatches == {}, "\n".join(f"{name}: {why}" for name, why in mismatches.items())
    seen = {row["type"] for row in rows}
    for expected in ("organization_created", "project_created", "ledger_topup", "ledger_reserve", "ledger_charge",
                     "ledger_refund", "run_created", "run_pending", "run_running", "run_completed", "run_failed",
                     "run_cancelled", "run_paused", "run_resuming", "run_deleted", "agent_running", "task_completed",
                     "step_pending", "step_completed", "step_failed", "escalation_open", "escalation_updated",
                     "escalation_acknowledged", "escalation_resolved", "approval_requested", "approval_granted",
                     "orchestrator_job_queued", "orchestrator_job_started", "orchestrator_job_completed",
                     "orchestrator_job_canceled", "job_probe_executed", "diagnosis_explanation",
                     "diagnosis_suggestion"):
        assert expected in seen, f"the scenario wrote no {expected} event"


def test_a_payload_the_document_does_not_describe_is_refused():
    """The payload schemas are strict: a key the code starts sending unannounced fails the test above."""
    document = wire(asyncapi_document())
    event = {"id": 1, "type": "run_deleted", "ts": "2026-01-01T00:00:00+00:00", "organization": 1, "project": 1,
             "run": 1, "reason": "typo"}
    assert payload_errors(document, "run_deleted", event) == []
    assert payload_errors(document, "run_deleted", {**event, "surprise": 1})
    assert payload_errors(document, "run_deleted", {**event, "type": "run_refunded"})
    assert payload_errors(document, "run_deleted", {key: v for key, v in event.items() if key != "reason"})
