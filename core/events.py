"""Event names the core writes (the ``type`` of ``core.Event`` rows), named once.

Each app declares the names it writes in its own ``events.py``: ``billing.events`` (ledger),
``jobs.events`` (jobs, worker sessions, commands), ``runs.events`` (runs, their hierarchy,
gates, approvals, drift, caps, escalations), ``diagnosis.events``. The values are on the
wire (event stream, WebSocket, stored rows): they never change.
"""

from __future__ import annotations

ORGANIZATION_CREATED = "organization_created"
PROJECT_CREATED = "project_created"
