"""A request body's unknown keys are refused (400 naming the field), never silently ignored."""

from __future__ import annotations

import pytest

from runs.models import Run
from tests.api.conftest import assert_error, create_run

pytestmark = pytest.mark.django_db


def test_unknown_fields_are_refused_on_every_post(tenant):
    body = assert_error(tenant.client.post("/api/v1/runs/", tenant.run_body(priorty=5), format="json"), 400,
                        "validation_error")
    assert "priorty" in body["errors"]
    assert not Run.objects.exists()
    run = create_run(tenant)
    for action, extra in (("start", {"reason": "go", "force": True}), ("cancel", {"reson": "typo"}),
                          ("retry", {"reason": "x", "plans": {}}), ("approve", {"gate": "g", "approval_ref": "r",
                                                                              "note": "x"})):
        body = assert_error(tenant.client.post(f"/api/v1/runs/{run['id']}/{action}/", extra, format="json"), 400,
                            "validation_error")
        unknown = next(key for key in extra if key not in ("reason", "gate", "approval_ref"))
        assert body["errors"] == {unknown: ["unknown field: not accepted here"]}, (action, body)
    assert Run.objects.get(pk=run["id"]).status == Run.Status.CREATED
    body = assert_error(tenant.client.post("/api/v1/jobs/", {"type": "echo", "args": {}, "lane": "x"}, format="json"),
                        400, "validation_error")
    assert "lane" in body["errors"]
    body = assert_error(tenant.client.post(f"/api/v1/runs/{run['id']}/suggest/", {"why": 1}, format="json"), 400,
                        "validation_error")
    assert "why" in body["errors"]
