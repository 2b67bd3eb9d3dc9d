"""A domain error names its code and status in its class line; a subclass keeps what it does not name."""

from __future__ import annotations

from core.errors import Conflict, DomainError
from jobs.errors import QueueFull
from runs.errors import ArtifactGone, DriftDetected


def test_an_error_class_line_names_its_code_and_status():
    assert (ArtifactGone.code, ArtifactGone.status) == ("artifact_expired", 410)
    assert (QueueFull.code, QueueFull.status, QueueFull.sends_retry_after) == ("queue_full", 429, True)


def test_a_subclass_that_names_no_status_keeps_its_base_status():
    assert (DriftDetected.code, DriftDetected.status) == ("drift_detected", Conflict.status) == ("drift_detected", 409)

    class Local(DomainError, code="local_error"):
        """An error of this test."""

    error = Local("detail", extra_field=1)
    assert (error.code, error.status, error.as_dict()) == ("local_error", 400,
                                                          {"code": "local_error", "detail": "detail", "extra_field": 1})
