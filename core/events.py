"""Event names the core writes (the ``type`` of ``core.Event`` rows), named once.

Each app declares the names it writes in its own ``events.py``: ``billing.events`` (ledger),
``jobs.events`` (jobs, worker sessions, commands), ``runs.events`` (runs, their hierarchy,
gates, approvals, drift, caps, escalations), ``diagnosis.events``. The values are on the
wire (event stream, WebSocket, stored rows): they never change.

The payload schema of each event (``EVENT_MESSAGES``) is part of the AsyncAPI document of the
events socket (``core.asyncapi``).
"""

from __future__ import annotations

from core.asyncapi import ID, INTEGER, STRING, EventMessage

ORGANIZATION_CREATED = "organization_created"
PROJECT_CREATED = "project_created"
BULK_OPERATION_PROGRESS = "bulk_operation_progress"  # a batch done, or the operation finished or aborted


def state_event(entity: str, status: str) -> str:
    """The event an object's move into ``status`` writes: ``<entity>_<status>`` (``run_completed``,
    ``step_failed``, ``escalation_open``, ``worker_session_ready`` ...)."""
    return f"{entity}_{status}"


# --- payload schemas -----------------------------------------------------------------------------

EVENT_MESSAGES = [
    EventMessage(types=("project_created",), summary="A project was created in an organization",
                 properties={"name": STRING}, required=("name",)),
    EventMessage(types=(BULK_OPERATION_PROGRESS,),
                 summary="A bulk runbook operation processed a batch, finished or was aborted (staff only)",
                 properties={"operationId": ID, "runbook": STRING, "status": {"enum": ["running", "finished",
                                                                                        "aborted"]},
                             "total": INTEGER, "done": INTEGER, "skipped": INTEGER, "refused": INTEGER},
                 required=("operationId", "runbook", "status", "total", "done", "skipped", "refused")),
]
