"""Seed 000's transition matrix, exactly: self transitions allowed, terminal states immutable,
every other move a deterministic ``JobConflict`` that changes nothing."""

import pytest

from core.models import Event
from jobs.errors import JobConflict
from jobs.models import TRANSITIONS, Job, JobState
from jobs.services import job_transition

STATES = list(JobState.values)
MATRIX = {
    "received": {"received", "queued", "failed", "cancelled"},
    "queued": {"queued", "executing", "failed", "cancelled"},
    "executing": {"executing", "awaiting_tool", "awaiting_user_confirmation", "completed", "failed", "cancelled"},
    "awaiting_tool": {"awaiting_tool", "executing", "failed", "cancelled"},
    "awaiting_user_confirmation": {"awaiting_user_confirmation", "executing", "failed", "cancelled"},
    "completed": {"completed"},
    "failed": {"failed"},
    "cancelled": {"cancelled"},
}
# A path through the matrix to reach each state from received.
PATHS = {
    "received": [],
    "queued": ["queued"],
    "executing": ["queued", "executing"],
    "awaiting_tool": ["queued", "executing", "awaiting_tool"],
    "awaiting_user_confirmation": ["queued", "executing", "awaiting_user_confirmation"],
    "completed": ["queued", "executing", "completed"],
    "failed": ["failed"],
    "cancelled": ["cancelled"],
}


def test_model_matrix_is_the_seed_matrix():
    assert {state: set(targets) for state, targets in TRANSITIONS.items()} == MATRIX


def _job_in(state, project):
    job = Job.objects.create(type="noop", organization_id=project.organization_id, project=project)
    for step in PATHS[state]:
        job_transition(job_id=job.pk, target=step)
    job.refresh_from_db()
    assert job.state == state
    return job


@pytest.mark.parametrize("source", STATES)
@pytest.mark.parametrize("target", STATES)
def test_every_pair_of_the_matrix(project, source, target):
    job = _job_in(source, project)
    events_before = Event.objects.count()
    if target in MATRIX[source]:
        moved = job_transition(job_id=job.pk, target=target)
        assert moved.state == target
        job.refresh_from_db()
        assert job.state == target
        if source == target and source in ("completed", "failed", "cancelled"):
            assert Event.objects.count() == events_before  # terminal self-transition is a no-op
        else:
            assert Event.objects.count() == events_before + 1
    else:
        with pytest.raises(JobConflict) as raised:
            job_transition(job_id=job.pk, target=target)
        assert raised.value.code == "job_conflict"
        assert raised.value.extra["from"] == source and raised.value.extra["to"] == target
        assert str(job.pk) in raised.value.detail
        job.refresh_from_db()
        assert job.state == source
        assert Event.objects.count() == events_before


def test_unknown_target_is_a_validation_error(project):
    from core.errors import ValidationFailed

    job = _job_in("queued", project)
    with pytest.raises(ValidationFailed):
        job_transition(job_id=job.pk, target="running")


def test_status_field_cannot_be_assigned(project):
    job = _job_in("queued", project)
    with pytest.raises(AttributeError):
        job.state = JobState.COMPLETED
