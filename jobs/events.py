"""Event names the jobs app writes, named once.

A job's events are seed 003's wire contract (``orchestrator_job_*``); its cancel event keeps
seed 003's spelling ``orchestrator_job_canceled``, which its clients expect (our own names
spell it "cancelled").

The payload schema of each event (``EVENT_MESSAGES``) is part of the AsyncAPI document of the
events socket (``core.asyncapi``).
"""

from __future__ import annotations

from functools import partial

from core.asyncapi import ANY, ID, INTEGER, STRING, TIMESTAMP, EventMessage, nullable
from core.events import state_event
from jobs.models import CommandKind, CommandStatus, JobState, PriorityClass, WorkerSessionStatus

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


# The event a worker session's move into a status writes (``worker_session_ready`` ...).
worker_session_event = partial(state_event, "worker_session")


QUEUE_PAUSED = "queue_paused"
QUEUE_RESUMED = "queue_resumed"

COMMAND_RECORDED = "command_recorded"
COMMAND_SUCCEEDED = "command_succeeded"
COMMAND_FAILED = "command_failed"


# --- payload schemas -----------------------------------------------------------------------------

# A job in seed 003's field names (``jobs.services.job_as_dict``).
JOB_PROPERTIES = {
    "jobId": ID, "projectId": ID, "jobType": STRING,
    "state": {"enum": list(JobState.values)},
    "reason": {**STRING, "description": "the reason code of the last move (`JobReason`), or empty"},
    "priority": {"enum": list(PriorityClass.values)},
    "lane": STRING, "attempts": INTEGER, "maxAttempts": INTEGER,
    "createdAt": nullable(TIMESTAMP), "startedAt": nullable(TIMESTAMP), "completedAt": nullable(TIMESTAMP),
    "error": nullable(STRING), "result": ANY,
    "sourceSessionId": STRING, "threadId": STRING, "runId": ID,
}
JOB_REQUIRED = ("jobId", "projectId", "jobType", "state", "reason", "priority", "lane", "attempts", "maxAttempts",
                "createdAt", "startedAt", "completedAt", "error", "result")


def _job_message(event_type: str, summary: str, extra: dict | None = None) -> EventMessage:
    return EventMessage(types=(event_type,), summary=summary, family="orchestrator_job_<event>",
                        properties={**JOB_PROPERTIES, **(extra or {})},
                        required=JOB_REQUIRED)


JOB_SUMMARIES = {
    JobState.QUEUED: "A job was enqueued",
    JobState.EXECUTING: "A worker claimed the job and started an attempt",
    JobState.COMPLETED: "The job completed (`result`)",
    JobState.FAILED: "The job failed for good (`reason`, `error`)",
    JobState.CANCELLED: "The job was cancelled",
}
CANCEL_REASON = {"cancelReason": {**STRING, "description": "why it was cancelled"}}

COMMAND_PROPERTIES = {
    "commandId": ID, "projectId": ID, "kind": {"enum": list(CommandKind.values)}, "idempotencyKey": STRING,
    "payloadHash": STRING, "status": {"enum": list(CommandStatus.values)}, "attempts": INTEGER,
    "errorCode": nullable(STRING), "error": nullable(STRING), "createdAt": nullable(TIMESTAMP),
    "completedAt": nullable(TIMESTAMP),
}
SESSION_PROPERTIES = {
    "sessionKey": {**STRING, "description": "`owner::agent`"}, "owner": STRING, "agent": STRING,
    "generation": INTEGER, "status": {"enum": list(WorkerSessionStatus.values)}, "reprovisionCount": INTEGER,
}
SESSION_REQUIRED = tuple(SESSION_PROPERTIES)
QUEUE_PAUSE_PROPERTIES = {
    "projectId": nullable(ID), "jobType": {**STRING, "description": "a paused job type, or empty for a project"},
    "actor": STRING, "reason": STRING, "since": nullable(TIMESTAMP),
}

EVENT_MESSAGES = [
    *(_job_message(name, JOB_SUMMARIES[state], CANCEL_REASON if state == JobState.CANCELLED else None)
      for state, name in JOB_STATE_EVENTS.items()),
    _job_message(JOB_PROGRESS, "Anything else about a job: progress of the attempt, a retry scheduled "
                                 "(`retryInMs`), a lost worker's job waiting again, a cancel requested from a "
                                 "running job, a duplicate merged into it", {
        "progress": {**ANY, "description": "what the attempt reported"},
        "retryInMs": {**INTEGER, "description": "a failed attempt: the next one after this backoff"},
        "cancelRequested": {"const": True}, **CANCEL_REASON,
        "merged": {"const": True, "description": "a duplicate's payload was merged into this job"},
    }),
    EventMessage(types=("job_probe_executed",), summary="A probe job ran one attempt (the reliability drills count "
                                                        "them)",
                 properties={"jobId": ID, "attempt": INTEGER, "worker": STRING},
                 required=("jobId", "attempt", "worker")),
    EventMessage(types=("command_recorded",), summary="A side-effecting command was recorded before its call",
                 properties=COMMAND_PROPERTIES, required=tuple(COMMAND_PROPERTIES), family="command_<outcome>"),
    EventMessage(types=("command_succeeded",), summary="A command's call succeeded",
                 properties=COMMAND_PROPERTIES, required=tuple(COMMAND_PROPERTIES), family="command_<outcome>"),
    EventMessage(types=("command_failed",), summary="A command's call failed (`final`: it will not be retried)",
                 properties={**COMMAND_PROPERTIES, "final": {"type": "boolean"}, "retryable": {"type": "boolean"}},
                 required=(*COMMAND_PROPERTIES, "final", "retryable"), family="command_<outcome>"),
    EventMessage(types=tuple(f"worker_session_{status}" for status in WorkerSessionStatus.values),
                 summary="A worker session changed status", family="worker_session_<status>",
                 properties={**SESSION_PROPERTIES, "error": STRING}, required=SESSION_REQUIRED),
    EventMessage(types=("worker_session_created",), summary="A worker session was created on its first job",
                 properties=SESSION_PROPERTIES, required=SESSION_REQUIRED),
    EventMessage(types=("worker_session_reprovisioned",), summary="A stale worker session got a new generation",
                 properties={**SESSION_PROPERTIES, "reason": STRING}, required=(*SESSION_REQUIRED, "reason")),
    EventMessage(types=("worker_session_preflight",), summary="A worker session's generation passed its preflight",
                 properties=SESSION_PROPERTIES, required=SESSION_REQUIRED),
    EventMessage(types=("worker_session_bootstrapped",), summary="A worker session ran a bootstrap",
                 properties={**SESSION_PROPERTIES, "bootstrapKey": STRING},
                 required=(*SESSION_REQUIRED, "bootstrapKey")),
    EventMessage(types=(QUEUE_PAUSED,), summary="A queue (a project's jobs, or a job type) was paused: its jobs "
                                                "stay queued and are not claimed",
                 properties=QUEUE_PAUSE_PROPERTIES, required=tuple(QUEUE_PAUSE_PROPERTIES), family="queue_<change>"),
    EventMessage(types=(QUEUE_RESUMED,), summary="A paused queue was resumed: its jobs are claimed again, in order",
                 properties=QUEUE_PAUSE_PROPERTIES, required=tuple(QUEUE_PAUSE_PROPERTIES), family="queue_<change>"),
]
