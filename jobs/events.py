"""Event names the jobs app writes, named once.

A job's events are seed 003's wire contract (``orchestrator_job_*``); its cancel event keeps
seed 003's spelling ``orchestrator_job_canceled``, which its clients expect (our own names
spell it "cancelled").
"""

from __future__ import annotations

from jobs.models import JobState

JOB_QUEUED = "orchestrator_job_queued"
JOB_STARTED = "orchestrator_job_started"
JOB_PROGRESS = "orchestrator_job_progress"
JOB_COMPLETED = "orchestrator_job_completed"
JOB_FAILED = "orchestrator_job_failed"
JOB_CANCELLED = "orchestrator_job_canceled"  # seed 003's spelling, on the wire

# The event a job's move into a state writes (any other move, and a self-transition, is progress).
JOB_STATE_EVENTS = {
    JobState.QUEUED: JOB_QUEUED,
    JobState.EXECUTING: JOB_STARTED,
    JobState.COMPLETED: JOB_COMPLETED,
    JobState.FAILED: JOB_FAILED,
    JobState.CANCELLED: JOB_CANCELLED,
}

JOB_PROBE_EXECUTED = "job_probe_executed"

WORKER_SESSION_CREATED = "worker_session_created"
WORKER_SESSION_REPROVISIONED = "worker_session_reprovisioned"
WORKER_SESSION_PREFLIGHT = "worker_session_preflight"
WORKER_SESSION_BOOTSTRAPPED = "worker_session_bootstrapped"


def worker_session_event(status: str) -> str:
    """The event a worker session's move into ``status`` writes (``worker_session_ready`` ...)."""
    return f"worker_session_{status}"


COMMAND_RECORDED = "command_recorded"
COMMAND_SUCCEEDED = "command_succeeded"
COMMAND_FAILED = "command_failed"
