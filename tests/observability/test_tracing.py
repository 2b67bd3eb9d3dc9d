"""OpenTelemetry traces: off unless ``OTEL_*`` turns them on; on, an API request, the job it
enqueues, the worker that runs it (in this process or another) and the run's steps are one trace."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
from django.db import connection
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from core import tracing
from jobs.models import Job, JobState
from runs.models import Run, Step
from tests.drive import drain_jobs
from tests.processes import BASE_DIR, Cluster, wait_for

RUN_PLAN = {"agents": [{"name": "a0", "tasks": [{"name": "t0", "steps": [
    {"name": "s0", "tool": "echo", "args": {"text": "hi"}}]}]}]}


@pytest.fixture
def spans():
    """Tracing on in this process, into memory, for one test."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.tracing_start(provider=provider)
    connection.close()  # the next query connects through the instrumented psycopg
    yield exporter
    tracing.tracing_stop()
    provider.shutdown()
    connection.close()  # later tests get an uninstrumented connection


def hex_trace(span) -> str:
    return trace.format_trace_id(span.context.trace_id)


def parent_of(span, finished):
    if span.parent is None:
        return None
    return next((other for other in finished if other.context.span_id == span.parent.span_id), None)


def attributes(span) -> dict:
    return {key: value for key, value in span.attributes.items() if key.startswith("orchestrator.")}


@pytest.mark.django_db(transaction=True)
def test_request_enqueue_job_and_step_spans_form_one_trace(spans, tenant, caplog):
    caplog.set_level(logging.INFO, logger="orchestrator.transitions")
    created = tenant.client.post("/api/v1/runs/", tenant.run_body(plan=RUN_PLAN), format="json")
    assert created.status_code == 201, created.content
    run_id = created.json()["id"]
    spans.clear()
    started = tenant.client.post(f"/api/v1/runs/{run_id}/start/", format="json")
    assert started.status_code == 200, started.content
    drain_jobs(until=lambda: Run.objects.get(pk=run_id).status == Run.Status.COMPLETED)
    finished = spans.get_finished_spans()

    request = next(span for span in finished if span.kind == trace.SpanKind.SERVER)
    assert request.parent is None and request.attributes["http.method"] == "POST"
    assert request.attributes["http.route"].startswith("api/v1/runs/") and request.attributes["http.status_code"] == 200
    trace_id = hex_trace(request)
    # The whole run is one trace; only the queue's own polling (database spans of the claims,
    # outside any job) starts traces of its own.
    assert {hex_trace(span) for span in finished if span.parent is not None or span.kind != trace.SpanKind.CLIENT} \
        == {trace_id}

    # The run's start queues, in its own transaction, the job that starts the run and runs its step.
    start_enqueue = next(span for span in finished if span.name == "jobs enqueue many"
                         and span.attributes["orchestrator.job_type"] == "run_step")
    assert parent_of(start_enqueue, finished) is request
    assert (start_enqueue.attributes["orchestrator.run_id"], start_enqueue.attributes["orchestrator.jobs"]) \
        == (run_id, 1)
    start_job = Job.objects.get(run_id=run_id)
    enqueue_id = trace.format_span_id(start_enqueue.context.span_id)
    assert start_job.traceparent == f"00-{trace_id}-{enqueue_id}-{int(start_enqueue.context.trace_flags):02x}"

    step = Step.objects.get(run_id=run_id)
    step_job = next(span for span in finished if span.name == "job run_step")
    assert parent_of(step_job, finished) is start_enqueue and step_job.kind == trace.SpanKind.CONSUMER
    assert attributes(step_job) == {
        "orchestrator.job_id": start_job.pk, "orchestrator.job_type": "run_step", "orchestrator.run_id": run_id,
        "orchestrator.attempt": 1, "orchestrator.organization_id": tenant.organization.pk,
        "orchestrator.project_id": tenant.project.pk, "orchestrator.outcome": "completed"}
    assert not [span for span in finished if span.name == "job run_tick"]  # no job between the start and the step
    if connection.vendor == "postgresql":  # psycopg is instrumented: the step's queries are its children
        assert any(span.kind == trace.SpanKind.CLIENT and parent_of(span, finished) is step_job for span in finished)
    step_span = next(span for span in finished if span.name == "run step")
    assert parent_of(step_span, finished) is step_job
    assert attributes(step_span) == {
        "orchestrator.run_id": run_id, "orchestrator.step_id": step.pk,
        "orchestrator.job_id": step_job.attributes["orchestrator.job_id"],
        "orchestrator.project_id": tenant.project.pk, "orchestrator.attempt": 1,
        "orchestrator.decision": "completed"}

    # The transition lines written while a span was active carry its trace id.
    lines = [record.fields for record in caplog.records if getattr(record, "fields", {}).get("event") == "transition"]
    nodes = [line for line in lines if line.get("entity") in ("agent", "task", "step") and line.get("run_id") == run_id]
    assert len(nodes) >= 6 and {line.get("trace_id") for line in nodes} == {trace_id}
    completed = [line for line in lines if line.get("entity") == "run" and line.get("to") == "completed"]
    assert [line.get("trace_id") for line in completed] == [trace_id]


@pytest.mark.django_db
def test_off_by_default_the_hooks_do_nothing(tenant, caplog, django_capture_on_commit_callbacks):
    assert tracing.ENABLED is False
    caplog.set_level(logging.INFO, logger="orchestrator.transitions")
    with django_capture_on_commit_callbacks(execute=True):
        response = tenant.client.post("/api/v1/jobs/", {"type": "noop", "project": tenant.project.pk,
                                                        "payload": {}}, format="json")
    assert response.status_code in (201, 202), response.content
    job = Job.objects.get()
    assert job.traceparent == ""
    assert tracing.tracing_traceparent() == "" and tracing.tracing_trace_id() == ""
    with tracing.tracing_span("anything", run_id=1) as span:
        assert span is None
    lines = [record.fields for record in caplog.records if getattr(record, "fields", {}).get("event") == "transition"]
    assert lines and all("trace_id" not in line for line in lines)


PROBE = """
import json
import sys

import django

django.setup()
from django.conf import settings

from core import tracing

print(json.dumps({"enabled": tracing.ENABLED, "sdk": "opentelemetry.sdk.trace" in sys.modules,
                  "middleware": any("opentelemetry" in name for name in settings.MIDDLEWARE)}))
"""


@pytest.mark.parametrize(("variables", "on"), [
    ({}, False),
    ({"OTEL_TRACES_EXPORTER": "none"}, False),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "TRUE"}, False),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "false"}, True),
])
def test_the_otel_variables_decide_once_per_process(variables, on):
    import os

    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.update({"DJANGO_SETTINGS_MODULE": "orchestrator_site.settings", **variables})
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=BASE_DIR, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    state = json.loads(out.stdout.strip().splitlines()[-1])
    # Off: the SDK is not even imported, and no middleware is added.
    assert state == {"enabled": on, "sdk": on, "middleware": on}


def console_spans(text: str) -> list[dict]:
    """The JSON documents ``ConsoleSpanExporter`` wrote, one after another."""
    decoder = json.JSONDecoder()
    found, position = [], 0
    while True:
        start = text.find("{", position)
        if start < 0:
            return found
        try:
            document, position = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            position = start + 1
            continue
        if isinstance(document, dict) and "context" in document:
            found.append(document)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_process_continues_the_trace_of_the_web_request(spans, tenant, tmp_path, monkeypatch):
    response = tenant.client.post("/api/v1/jobs/", {"type": "noop", "project": tenant.project.pk, "payload": {}},
                                  format="json")
    assert response.status_code in (201, 202), response.content
    request = next(span for span in spans.get_finished_spans() if span.kind == trace.SpanKind.SERVER)
    enqueue = next(span for span in spans.get_finished_spans() if span.name == "job enqueue")
    trace_id = hex_trace(request)
    job = Job.objects.get(pk=enqueue.attributes["orchestrator.job_id"])
    assert job.traceparent.split("-")[1] == trace_id

    span_file = tmp_path / "spans.json"
    log = tmp_path / "qcluster.log"
    with Cluster(log, ORCHESTRATOR_Q_NAME="traced", OTEL_TRACES_EXPORTER="console",
                 ORCHESTRATOR_OTEL_CONSOLE_FILE=span_file, OTEL_SERVICE_NAME="orchestrator-worker",
                 ORCHESTRATOR_TRANSITION_LOG_LEVEL="INFO"):
        from jobs.wake import wake_workers

        monkeypatch.undo()  # this test's worker needs the broker's message
        wake_workers(force=True)
        wait_for(lambda: Job.objects.get(pk=job.pk).state == JobState.COMPLETED, timeout=90, interval=0.2,
                 message="the job completed by the worker")
        wait_for(lambda: span_file.exists() and '"job noop"' in span_file.read_text(), timeout=30,
                 message="the worker's span exported")
    worker_spans = console_spans(span_file.read_text())
    executed = next(span for span in worker_spans if span["name"] == "job noop")
    assert executed["context"]["trace_id"] == f"0x{trace_id}"
    assert executed["parent_id"] == f"0x{trace.format_span_id(enqueue.context.span_id)}"
    assert executed["kind"] == "SpanKind.CONSUMER"
    assert executed["attributes"]["orchestrator.job_id"] == job.pk
    assert executed["attributes"]["orchestrator.organization_id"] == tenant.organization.pk
    assert executed["resource"]["attributes"]["service.name"] == "orchestrator-worker"
    # The worker's transition lines of that job carry the same trace id.
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{") and '"transition"' in line]
    finished = [line for line in lines if line.get("job_id") == job.pk and line.get("to") == "completed"]
    assert [line.get("trace_id") for line in finished] == [trace_id]
