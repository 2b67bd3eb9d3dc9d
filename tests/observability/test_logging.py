"""Structured logs: one JSON line per state transition, with the same keys for runs, jobs and the
run's agents, tasks and steps, written when the transition commits."""

from __future__ import annotations

import json
import logging

import pytest
from django.db import transaction

from core.logging import JsonFormatter, TextFormatter
from jobs.services import job_cancel, job_enqueue
from runs import services as run_services
from tests.conftest import make_plan
from tests.drive import drain_jobs

pytestmark = pytest.mark.django_db(transaction=True)  # lines are written on commit
LOGGER = "orchestrator.transitions"
REQUIRED = ("entity", "type", "project_id", "run_id", "attempt", "from", "to", "reason")


def transition_lines(caplog) -> list[dict]:
    """The JSON lines the configured formatter writes for the captured transition records."""
    formatter = JsonFormatter()
    lines = []
    for record in caplog.records:
        if record.name != LOGGER:
            continue
        text = formatter.format(record)
        assert "\n" not in text
        lines.append(json.loads(text))
    return lines


def test_a_job_logs_one_line_per_transition_with_every_field(caplog, project):
    caplog.set_level(logging.INFO, logger=LOGGER)
    job = job_enqueue(job_type="noop", project=project, payload={}).job
    drain_jobs()
    lines = [line for line in transition_lines(caplog) if line["entity"] == "job"]
    assert [(line["from"], line["to"]) for line in lines] == [
        ("received", "queued"), ("queued", "executing"), ("executing", "completed")]
    for line in lines:
        assert set(REQUIRED) <= set(line), line
        assert line["job_id"] == job.pk
        assert line["project_id"] == project.pk
        assert line["type"] == "noop"
        assert line["event"] == "transition"
        assert line["logger"] == LOGGER and line["level"] == "info"
    assert [line["attempt"] for line in lines] == [0, 1, 1]
    assert [line["reason"] for line in lines] == ["enqueued", "", "completed"]


def test_a_cancelled_job_says_why(caplog, project):
    caplog.set_level(logging.INFO, logger=LOGGER)
    job = job_enqueue(job_type="noop", project=project, payload={}).job
    job_cancel(job_id=job.pk, reason="operator said so")
    last = transition_lines(caplog)[-1]
    assert (last["job_id"], last["from"], last["to"], last["reason"]) == (job.pk, "queued", "cancelled", "cancelled")


def test_runs_and_their_jobs_share_key_names(caplog, project, monkeypatch):
    monkeypatch.setattr("jobs.wake._send", lambda count: None)
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = run_services.run_create(project=project, name="logged", plan=make_plan())
    run_services.run_start(run_id=run.pk)
    run_services.run_cancel(run_id=run.pk, reason="changed my mind")
    lines = transition_lines(caplog)
    runs = [line for line in lines if line["entity"] == "run"]
    assert [(line["from"], line["to"]) for line in runs] == [
        ("", "created"), ("created", "pending"), ("pending", "cancelled")]
    for line in runs:
        assert set(REQUIRED) <= set(line), line
        assert (line["run_id"], line["project_id"], line["type"], line["attempt"]) == (run.pk, project.pk, "run", 1)
    assert runs[-1]["reason"] == "changed my mind"
    jobs = [line for line in lines if line["entity"] == "job"]
    assert jobs, "starting a run enqueues its first job"
    assert all(line["run_id"] == run.pk and line["project_id"] == project.pk for line in jobs)


def test_every_agent_task_and_step_transition_of_a_run_is_a_line(caplog, project, monkeypatch):
    monkeypatch.setattr("jobs.wake._send", lambda count: None)
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = run_services.run_create(project=project, name="nodes", plan=make_plan(tasks=2, steps=2))
    run_services.run_start(run_id=run.pk)
    drain_jobs()
    lines = transition_lines(caplog)
    for entity, count in (("agent", 1), ("task", 2), ("step", 4)):
        moves = [line for line in lines if line["entity"] == entity]
        assert len({line[f"{entity}_id"] for line in moves}) == count, entity
        for line in moves:
            assert set(REQUIRED) <= set(line), line
            assert (line["run_id"], line["project_id"], line["attempt"]) == (run.pk, project.pk, 1)
        by_node = {}
        for line in moves:
            by_node.setdefault(line[f"{entity}_id"], []).append((line["from"], line["to"]))
        assert all(path == [("pending", "running"), ("running", "completed")] for path in by_node.values()), by_node


def test_a_failed_step_says_why(caplog, project, monkeypatch):
    monkeypatch.setattr("jobs.wake._send", lambda count: None)
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = run_services.run_create(project=project, name="fails", plan=make_plan(tool="fail", args={"mode": "fatal"}))
    run_services.run_start(run_id=run.pk)
    drain_jobs()
    failed = [(line["entity"], line["reason"]) for line in transition_lines(caplog) if line["to"] == "failed"]
    assert ("step", "drill_fatal") in failed and ("agent", "drill_fatal") in failed and ("run", "drill_fatal") in failed


def test_a_transition_rolled_back_writes_no_line(caplog, project):
    caplog.set_level(logging.INFO, logger=LOGGER)
    job = job_enqueue(job_type="noop", project=project, payload={}).job
    caplog.clear()
    with pytest.raises(RuntimeError), transaction.atomic():
        job_cancel(job_id=job.pk, reason="changed my mind")
        raise RuntimeError("the caller's transaction fails")
    assert transition_lines(caplog) == []
    job.refresh_from_db()
    assert job.state == "queued"


def test_the_configured_handler_writes_json_lines():
    """settings.LOGGING (LOG_FORMAT=json by default) puts our formatter on the console handler."""
    handlers = logging.getLogger().handlers
    formatters = [handler.formatter for handler in handlers if isinstance(handler.formatter, JsonFormatter)]
    assert formatters, [type(handler.formatter) for handler in handlers]
    assert logging.getLogger(LOGGER).isEnabledFor(logging.INFO)
    record = logging.LogRecord(LOGGER, logging.INFO, __file__, 1, "job %s moved", (7,), None)
    record.fields = {"job_id": 7, "from": "queued", "to": "executing", "reason": "line\nbreak", "message": "x"}
    text = formatters[0].format(record)
    assert "\n" not in text
    line = json.loads(text)
    assert line["message"] == "job 7 moved"
    assert line["field_message"] == "x"  # a field never overwrites the record's own keys
    assert (line["job_id"], line["from"], line["to"], line["reason"]) == (7, "queued", "executing", "line\nbreak")


def test_exceptions_stay_on_one_line():
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        import sys

        record = logging.LogRecord("orchestrator.relay", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exc"]


def test_the_text_format_keeps_the_fields():
    record = logging.LogRecord(LOGGER, logging.INFO, __file__, 1, "run 3 pending -> running", (), None)
    record.fields = {"run_id": 3, "to": "running"}
    text = TextFormatter().format(record)
    assert "run 3 pending -> running" in text and 'run_id=3' in text and 'to="running"' in text
