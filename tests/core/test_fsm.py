"""``core.fsm.StateMove``: a one-line declaration gives the model the same django-fsm transition a
decorated no-op method would."""

from __future__ import annotations

import pytest
from django_fsm import TransitionNotAllowed, can_proceed

from jobs.models import Job, JobState
from runs.models import Run


def test_a_state_move_is_a_named_transition_method_of_its_model():
    run = Run(status=Run.Status.CREATED)
    assert Run.start.__name__ == "start"
    assert can_proceed(run.start) and not can_proceed(run.complete)
    run.start()
    assert run.status == Run.Status.PENDING
    assert {t.name for t in run.get_available_status_transitions()} == {"cancel", "fail", "mark_running"}


def test_a_state_move_refuses_a_source_it_does_not_list_naming_itself():
    job = Job(state=JobState.COMPLETED)
    with pytest.raises(TransitionNotAllowed, match="using method 'to_queued'"):
        job.to_queued()
    assert job.state == JobState.COMPLETED
