"""Event names the diagnosis app writes (the run panel listens for them).

The payload schema of each event (``EVENT_MESSAGES``) is part of the AsyncAPI document of the
events socket (``core.asyncapi``).
"""

from __future__ import annotations

from core.asyncapi import ANY, ID, INTEGER, STRING, TIMESTAMP, EventMessage, nullable, ref
from diagnosis.models import Explanation, Suggestion
from runs.models import Run

EXPLANATION_EVENT = "diagnosis_explanation"
SUGGESTION_EVENT = "diagnosis_suggestion"


# --- payload schemas -----------------------------------------------------------------------------

SCHEMAS = {
    "Explanation": {
        "type": "object", "description": "A failed step attempt's explanation, under its stable id",
        "properties": {
            "id": {**STRING, "description": "`explanation-<run>-<step>-<attempt>`"},
            "run": ID, "step": ID, "step_attempt": ID, "attempt": INTEGER, "error_code": STRING,
            "status": {"enum": list(Explanation.Status.values)}, "text": STRING, "job": nullable(ID),
            "created_at": nullable(TIMESTAMP), "updated_at": nullable(TIMESTAMP), "explained_at": nullable(TIMESTAMP),
        },
        "required": ["id", "run", "step", "step_attempt", "attempt", "error_code", "status", "text", "job",
                     "created_at", "updated_at", "explained_at"],
        "additionalProperties": False,
    },
    "Suggestion": {
        "type": "object", "description": "A suggested next action for a run",
        "properties": {
            "id": ID, "run": ID, "job": nullable(ID), "status": {"enum": list(Suggestion.Status.values)},
            "action": STRING, "text": STRING, "facts": ANY, "requested_by": nullable(STRING),
            "requested_at": nullable(TIMESTAMP), "completed_at": nullable(TIMESTAMP),
            "run_status_at_request": {"enum": list(Run.Status.values)}, "run_status": {"enum": list(Run.Status.values)},
            "stale": {"type": "boolean", "description": "the run changed after the request"},
        },
        "required": ["id", "run", "job", "status", "action", "text", "facts", "requested_by", "requested_at",
                     "completed_at", "run_status_at_request", "run_status", "stale"],
        "additionalProperties": False,
    },
}

EVENT_MESSAGES = [
    EventMessage(types=(EXPLANATION_EVENT,), summary="A failed step attempt's explanation appeared or changed",
                 properties={"explanation": ref("Explanation"),
                             "failure": {**STRING, "description": "the failure in one line"}},
                 required=("explanation",), schemas=SCHEMAS),
    EventMessage(types=(SUGGESTION_EVENT,), summary="A suggestion was requested, answered or could not be made",
                 properties={"suggestion": ref("Suggestion")}, required=("suggestion",), schemas=SCHEMAS),
]
