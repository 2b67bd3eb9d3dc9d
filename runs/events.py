"""Event names the runs app writes, named once.

A run's move into a state writes ``run_<state>``; an agent's, task's or step's ``<entity>_<state>``;
an escalation's ``escalation_<state>``. The other events are named below.

The payload schema of each event (``EVENT_MESSAGES``) is part of the AsyncAPI document of the
events socket (``core.asyncapi``).
"""

from __future__ import annotations

from functools import partial

from core.asyncapi import ANY, ID, INTEGER, STRING, EventMessage, nullable, ref
from core.events import state_event
from runs.models import EscalationTicket, GateReceipt, NodeStatus, Run

# The event a move into a status writes (``core.events.state_event``): ``run_completed``,
# ``escalation_open``; an agent's, task's or step's ``node_event("step", "failed")``.
run_event = partial(state_event, "run")
node_event = state_event
escalation_event = partial(state_event, "escalation")

RUN_REPLANNED = "run_replanned"
RUN_RETRY_REFUSED = "run_retry_refused"
RUN_REFUNDED = "run_refunded"
RUN_DELETED = "run_deleted"
RUN_STOPPED = "run_stopped"
RUN_CAP_EXCEEDED = "run_cap_exceeded"
RUN_DRIFT_DETECTED = "run_drift_detected"
RUN_DRIFT_ACKNOWLEDGED = "run_drift_acknowledged"

GATE_PASSED = "gate_passed"
GATE_FAILED = "gate_failed"
GATE_REVALIDATED = "gate_revalidated"

APPROVAL_REQUESTED = "approval_requested"
APPROVAL_GRANTED = "approval_granted"

ESCALATION_UPDATED = "escalation_updated"


# --- payload schemas -----------------------------------------------------------------------------

SCHEMAS = {
    "ErrorInfo": {"type": "object", "properties": {"code": STRING, "message": STRING},
                  "required": ["code", "message"], "additionalProperties": False},
    "Drift": {"type": "object", "properties": {"dimension": STRING, "recorded": ANY, "live": ANY},
              "required": ["dimension", "recorded", "live"], "additionalProperties": False},
}
RUN_STATUS = {"enum": list(Run.Status.values)}
NODE_STATUS = {"enum": list(NodeStatus.values)}
ESCALATION_FIELDS = {
    "escalation": {**ID, "description": "the ticket"},
    "trigger": {"enum": list(EscalationTicket.Trigger.values)},
    "severity": STRING,
}


def _node_message(entity: str, parent: str | None) -> EventMessage:
    properties = {
        entity: ID, "name": STRING, "from": NODE_STATUS, "to": NODE_STATUS,
        "attempt": {**INTEGER, "description": "the run's attempt"},
        "error": ref("ErrorInfo"),
    }
    required = [entity, "name", "from", "to", "attempt"]
    if parent:
        properties[parent] = {**ID, "description": f"the {parent} it belongs to"}
        required.append(parent)
    if entity == "step":
        properties["retry_in_ms"] = {**INTEGER, "description": "a failed try that will be retried after this backoff"}
        properties["try"] = {**INTEGER, "description": "the failed try's number in this round"}
    return EventMessage(types=tuple(f"{entity}_{status}" for status in NodeStatus.values),
                        family=f"{entity}_<status>", summary=f"A{'n' if entity == 'agent' else ''} {entity} changed "
                                                             f"status (`from` → `to`)",
                        properties=properties, required=tuple(required), schemas=SCHEMAS)


EVENT_MESSAGES = [
    EventMessage(
        types=tuple(f"run_{status}" for status in Run.Status.values), family="run_<status>",
        summary="A run changed status, or an action left it in its status (`from` → `to`)",
        properties={
            "name": STRING, "from": {"enum": ["", *Run.Status.values], "description": "empty for `run_created`"},
            "to": RUN_STATUS,
            "status_reason": {**STRING, "description": "why the run is paused or stopped"},
            "attempt": INTEGER, "credits_reserved": INTEGER, "credits_charged": INTEGER, "credits_refunded": INTEGER,
            "reason": {**STRING, "description": "the reason given with the action"},
            "actor": {**STRING, "description": "who did it (`system` for the engine)"},
            "error": ref("ErrorInfo"),
            "released_keys": {"type": "array", "items": STRING,
                              "description": "cancelled or voided gated run: the pipeline keys it released"},
            "voided_approvals": {**INTEGER, "description": "cancelled or voided gated run: approvals voided"},
        },
        required=("name", "from", "to", "status_reason", "attempt", "credits_reserved", "credits_charged",
                  "credits_refunded", "reason", "actor"),
        schemas=SCHEMAS),
    _node_message("agent", None),
    _node_message("task", "agent"),
    _node_message("step", "task"),
    EventMessage(types=tuple(f"escalation_{status}" for status in EscalationTicket.Status.values),
                 family="escalation_<status>", summary="An escalation ticket was opened, acknowledged or resolved",
                 properties={**ESCALATION_FIELDS, "from": {"enum": ["", *EscalationTicket.Status.values],
                                                           "description": "empty when opened"},
                             "to": {"enum": list(EscalationTicket.Status.values)}, "detail": STRING},
                 required=("escalation", "trigger", "from", "to", "severity", "detail")),
    EventMessage(types=("escalation_updated",), summary="An unresolved ticket's trigger fired again: it gained a line",
                 properties={**ESCALATION_FIELDS, "status": {"enum": list(EscalationTicket.Status.values)},
                             "added": STRING},
                 required=("escalation", "trigger", "status", "added", "severity")),
    EventMessage(types=("gate_passed", "gate_failed", "gate_revalidated"), family="gate_<outcome>",
                 summary="A gate's check ran (a revalidation re-checks a passed gate); its receipt is stored",
                 properties={"gate": STRING, "check": STRING, "kind": {"enum": list(GateReceipt.Kind.values)},
                             "receipt": ID, "passed": {"type": "boolean"},
                             "invariants": {"type": "object", "description": "invariant → held"},
                             "phase": nullable(STRING)},
                 required=("gate", "check", "kind", "receipt", "passed", "invariants", "phase")),
    EventMessage(types=("approval_requested",), summary="A sovereign gate waits for a human approval (the run pauses)",
                 properties={"gate": STRING, "approval": ID,
                             "asked": {"type": "object", "description": "what the approver is asked, and the pins"}},
                 required=("gate", "approval", "asked")),
    EventMessage(types=("approval_granted",), summary="A gate was approved (the run resumes)",
                 properties={"gate": STRING, "approval": ID, "approval_ref": STRING},
                 required=("gate", "approval", "approval_ref")),
    EventMessage(types=("run_drift_detected",), summary="A pinned context value drifted before a gate: the run stops",
                 properties={"before": {**STRING, "description": "the gate it was checked before"},
                             "drift": {"type": "array", "items": ref("Drift")}},
                 required=("before", "drift"), schemas=SCHEMAS),
    EventMessage(types=("run_drift_acknowledged",), summary="An operator accepted the run's drift",
                 properties={"drift": {"type": "array", "items": ref("Drift")}, "reason": STRING, "actor": STRING},
                 required=("drift", "reason", "actor"), schemas=SCHEMAS),
    EventMessage(types=("run_stopped",), summary="Why a stopped run is stopped changed (`status_reason`)",
                 properties={"status": RUN_STATUS, "from": STRING, "status_reason": STRING},
                 required=("status", "from", "status_reason")),
    EventMessage(types=("run_retry_refused",), summary="An automatic retry was refused (not enough credits)",
                 properties={"reason": STRING}, required=("reason",)),
    EventMessage(types=("run_replanned",), summary="Failed agents were replaced by the planner's new agents",
                 properties={"replan_count": INTEGER, "failed_agents": {"type": "array", "items": STRING},
                             "new_agents": {"type": "array", "items": STRING},
                             "credits_reserved": {**INTEGER, "description": "the new work's worst-case cost, held "
                                                                            "for the attempt"}},
                 required=("replan_count", "failed_agents", "new_agents")),
    EventMessage(types=("run_refunded",), summary="Charged credits were given back to the organization",
                 properties={"amount": INTEGER, "reason": STRING}, required=("amount", "reason")),
    EventMessage(types=("run_deleted",), summary="A run that never started was deleted",
                 properties={"reason": STRING}, required=("reason",)),
    EventMessage(types=("run_cap_exceeded",), summary="A gated run passed a time cap: it stops and is escalated",
                 properties={"cap": {**STRING, "description": "`hard_cap` or `soft_cap:<phase>`"}, "detail": STRING,
                             "active_ms": INTEGER},
                 required=("cap", "detail", "active_ms")),
]
