"""Hostile bodies and queries against every POST endpoint: a 4xx in the error shape, never a 500.

Deep nesting (``json_too_deep`` at ``ORCHESTRATOR_JSON_MAX_DEPTH``, before anything recursive
sees the body), non-finite numbers, lone surrogates, NUL characters, numbers past every range,
bodies of the wrong shape or encoding; plans over the size caps and credit limits below one try
of each step.
"""

from __future__ import annotations

import json

import pytest

from jobs.models import Job
from runs.services import escalations
from runs.models import Run
from tests.api.conftest import assert_error, create_run
from tests.conftest import make_plan

pytestmark = pytest.mark.django_db

ACTIONS = ("start", "cancel", "pause", "resume", "retry", "approve", "acknowledge-drift", "void", "suggest")


@pytest.fixture
def targets(tenant_factory, settings):
    """A tenant and the path of every POST endpoint, on objects of its own."""
    settings.ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS = 20
    tenant = tenant_factory(credits=10**6)
    run = create_run(tenant)
    ticket, _ = escalations.escalation_open(run=Run.objects.get(pk=run["id"]), trigger="manual", detail="x")
    job = tenant.client.post("/api/v1/jobs/", {"type": "noop", "project": tenant.project.pk, "payload": {}},
                             format="json").json()
    paths = ["/api/v1/runs/", *(f"/api/v1/runs/{run['id']}/{action}/" for action in ACTIONS), "/api/v1/jobs/",
             f"/api/v1/jobs/{job['jobId']}/cancel/", f"/api/v1/escalations/{ticket.pk}/acknowledge/",
             f"/api/v1/escalations/{ticket.pk}/resolve/"]
    return tenant, paths


def nested(depth: int, inner: str = "1") -> str:
    """``depth`` objects, one in another, around ``inner``."""
    return '{"a": ' * depth + inner + "}" * depth


def every_field(project: int, value: str) -> str:
    """A body naming every field of every POST endpoint, each with the raw JSON ``value``."""
    fields = ["name", "reason", "gate", "approval_ref", "dimension", "type", "sourceSessionId", "mode",
              "failure_mode", "priority", "max_attempts", "credit_limit", "wait_ms"]
    return ('{"project": %d, "plan": {"agents": [{"name": "a", "tasks": [{"name": "t", "steps": [{"name": "s", '
            '"tool": "echo", "args": {"text": %s}}]}]}]}, "payload": {"value": %s}, ' % (project, value, value)
            + ", ".join(f'"{field}": {value}' for field in fields) + "}")


# name → (body built from the project id, status, code, the key of errors that must name it)
HOSTILE = {
    "nested_33_levels": (lambda p: '{"project": %d, "name": "x", "reason": "r", "plan": %s}' % (p, nested(32)),
                         400, "json_too_deep", None),
    "nested_800_levels": (lambda p: '{"project": %d, "name": "x", "plan": %s, "payload": %s}'
                          % (p, "[" * 800 + "]" * 800, nested(800)), 400, "json_too_deep", None),
    "nested_100000_levels": (lambda p: "[" * 100_000 + "]" * 100_000, 400, "json_too_deep", None),
    "overflow_to_infinity": (lambda p: every_field(p, "1e400"), 400, "validation_error", "body"),
    "overflow_to_minus_infinity": (lambda p: every_field(p, "-1e400"), 400, "validation_error", "body"),
    "nan_and_infinity_literals": (lambda p: every_field(p, "NaN").replace('"reason": NaN', '"reason": Infinity'),
                                  400, "validation_error", "body"),
    "lone_surrogate_in_values": (lambda p: every_field(p, '"\\ud800"'), 400, "validation_error", "body"),
    "lone_surrogate_in_a_key": (lambda p: '{"project": %d, "name": "x", "reason": "r", "gate": "g", '
                                '"approval_ref": "a", "type": "noop", "plan": {"\\udfff": 1}, "payload": '
                                '{"\\udfff": 1}}' % p, 400, "validation_error", "body"),
    "integer_of_5000_digits": (lambda p: every_field(p, "9" * 5000), 400, "validation_error", "body"),
}


@pytest.mark.parametrize("name", HOSTILE)
@pytest.mark.parametrize("idempotency_key", [None, "hostile"], ids=["no_key", "with_key"])
def test_a_hostile_body_is_refused_in_the_error_shape_by_every_post_endpoint(targets, name, idempotency_key):
    tenant, paths = targets
    build, status, code, field = HOSTILE[name]
    runs_before, jobs_before = Run.objects.count(), Job.objects.count()
    for path in paths:
        headers = {"HTTP_IDEMPOTENCY_KEY": f"{idempotency_key}-{path}"} if idempotency_key else {}
        response = tenant.client.post(path, build(tenant.project.pk).encode("utf-8", "surrogatepass"),
                                      content_type="application/json", **headers)
        body = assert_error(response, status, code)
        if code == "json_too_deep":
            assert body["max_depth"] == 32 and "ORCHESTRATOR_JSON_MAX_DEPTH" in body["detail"], (path, body)
        if field:
            assert field in body["errors"], (path, body)
    assert (Run.objects.count(), Job.objects.count()) == (runs_before, jobs_before)


def test_a_body_at_the_depth_limit_is_accepted_and_the_limit_is_a_setting(tenant, settings):
    plan = make_plan()
    plan["agents"][0]["tasks"][0]["steps"][0]["args"]["extra"] = json.loads(nested(22, "[]"))  # levels 10 to 32
    body = json.dumps(tenant.run_body(plan=plan))
    assert tenant.client.post("/api/v1/runs/", body, content_type="application/json").status_code == 201
    settings.ORCHESTRATOR_JSON_MAX_DEPTH = 31
    body = assert_error(tenant.client.post("/api/v1/runs/", body, content_type="application/json"), 400,
                        "json_too_deep")
    assert body["max_depth"] == 31


@pytest.mark.parametrize("raw, content_type, status, code", [
    (b'{"reason": "\xff\xfe"}', "application/json", 400, "validation_error"),  # not UTF-8
    (b'{"reason": "\xed\xa0\x80"}', "application/json", 400, "validation_error"),  # an encoded surrogate
    ('{"reason": "x"}'.encode("utf-16"), "application/json; charset=utf-8", 400, "validation_error"),
    (b"[1, 2]", "application/json", 400, "validation_error"),  # an array where an object is expected
    (b'"reason"', "application/json", 400, "validation_error"),
    (b"null", "application/json", 400, "validation_error"),
    (b"", "application/json", 400, "validation_error"),
    (b"<reason>x</reason>", "application/xml", 415, "unsupported_media_type"),
    (b"reason=x", "text/plain", 415, "unsupported_media_type"),
], ids=["invalid_utf8", "encoded_surrogate", "utf16_as_utf8", "array", "string", "null",
        "empty", "xml", "text"])
def test_bodies_of_the_wrong_shape_or_encoding_are_4xx(targets, raw, content_type, status, code):
    tenant, paths = targets
    for path in paths:
        if path.endswith("/suggest/") and raw.startswith((b"[", b'"', b"null")):
            continue  # it reads no field: well-formed JSON of any shape is ignored
        if path.endswith(("/cancel/", "/acknowledge/", "/start/", "/pause/", "/resume/", "/retry/", "/suggest/")) \
                and raw == b"":
            continue  # an empty body is no body: these need none
        assert_error(tenant.client.post(path, raw, content_type=content_type), status, code)


def test_nul_characters_in_any_string_field_are_400(targets):
    """PostgreSQL refuses U+0000 in text and jsonb (a 500 there if it got that far)."""
    tenant, paths = targets
    body = json.loads(every_field(tenant.project.pk, '"x\\u0000y"'))
    for field in ("priority", "max_attempts", "credit_limit", "wait_ms"):
        del body[field]
    runs_before, jobs_before = Run.objects.count(), Job.objects.count()
    for path in paths:
        if path.endswith("/suggest/"):
            continue  # it reads no field
        assert_error(tenant.client.post(path, body, format="json"), 400, "validation_error")
    assert (Run.objects.count(), Job.objects.count()) == (runs_before, jobs_before)


def test_too_many_query_parameters_answer_in_the_error_shape(tenant):
    body = assert_error(tenant.client.get("/api/v1/runs/?" + "a=1&" * 1_001), 400, "validation_error")
    assert "DATA_UPLOAD_MAX_NUMBER_FIELDS" in body["errors"]["query"][0]


@pytest.mark.parametrize("query", ["after=abc", "after=99999999999999999999999", "after=-1", "limit=1e9",
                                   "limit=0", "run=nan", "project=%00", "organization=%ed%a0%80"])
def test_odd_event_queries_are_400(tenant, query):
    for path in ("/api/v1/events/", f"/api/v1/runs/{create_run(tenant)['id']}/events/"):
        if path != "/api/v1/events/" and query.split("=")[0] not in ("after", "limit"):
            continue
        assert_error(tenant.client.get(f"{path}?{query}"), 400, "validation_error")


def test_put_and_patch_with_a_hostile_body_stay_405(targets):
    tenant, paths = targets
    for path in (paths[0], paths[1].replace("start/", "")):
        for method in (tenant.client.put, tenant.client.patch):
            assert_error(method(path, "[" * 5_000 + "]" * 5_000, content_type="application/json"), 405,
                         "method_not_allowed")


# --- plans -----------------------------------------------------------------------------------

def test_a_plan_over_a_size_cap_is_400_naming_the_cap_and_creates_nothing(tenant):
    response = tenant.client.post("/api/v1/runs/", tenant.run_body(plan=make_plan(steps=101)), format="json")
    body = assert_error(response, 400, "validation_error")
    assert body["errors"] == {"agents[0].tasks[0].steps": [
        "at most 100 steps in a task (ORCHESTRATOR_PLAN_MAX_STEPS_PER_TASK); this one has 101"]}
    response = tenant.client.post("/api/v1/runs/", tenant.run_body(plan=make_plan(agents=51)), format="json")
    assert "ORCHESTRATOR_PLAN_MAX_AGENTS" in assert_error(response, 400, "validation_error")["errors"]["plan.agents"][0]
    assert not Run.objects.exists()


def test_a_credit_limit_below_one_try_of_each_step_is_400_naming_the_minimum(tenant):
    plan = make_plan(tasks=2, steps=3)  # six echo steps, 1 credit a try
    response = tenant.client.post("/api/v1/runs/", tenant.run_body(plan=plan, credit_limit=5), format="json")
    body = assert_error(response, 400, "validation_error")
    assert body["errors"] == {"credit_limit": ["at least 6: one try of each step of the plan costs 6 credits"]}
    assert not Run.objects.exists()
    assert create_run(tenant, plan=plan, credit_limit=6)["credit_limit"] == 6


@pytest.mark.parametrize("variable, value, message", [
    ("ORCHESTRATOR_JSON_MAX_DEPTH", "0", "ORCHESTRATOR_JSON_MAX_DEPTH must be from 2 to 500"),
    ("ORCHESTRATOR_PLAN_MAX_STEPS", "-1", "ORCHESTRATOR_PLAN_MAX_STEPS must be at least 1"),
])
def test_a_limit_that_would_refuse_everything_fails_at_start_up(variable, value, message):
    import os
    import subprocess
    import sys

    environment = {**os.environ, variable: value, "DJANGO_SETTINGS_MODULE": "orchestrator_site.settings"}
    result = subprocess.run([sys.executable, "-c", "import django; django.setup()"], env=environment,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-500:]
