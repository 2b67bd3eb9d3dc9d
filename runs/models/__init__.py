"""Runs and their hierarchy: Run → Agent → Task → Step, with attempts and artifacts.

Every status is a django-fsm-2 ``FSMField(protected=True)``: only the transition methods
change it, and only the services in ``runs/services/`` call them (under the run's row lock).
Transition methods set fields on ``self`` and nothing else.

The package by aggregate (``from runs.models import X`` reaches every model and state group):

- ``run``: ``Run``, ``RunAttempt``, the run's state groups, failure and parallelism modes.
- ``hierarchy``: ``Agent``, ``Task``, ``Step``, ``StepAttempt``, ``NodeStatus`` and the node state groups.
- ``pipeline``: ``ApprovalRequest``, ``PhaseRecord``, ``GateReceipt``, ``ContextPin``, ``DriftRecord``, ``PipelineKey``.
- ``escalation``: ``EscalationTicket`` and ``OPEN_ESCALATION_STATES``.
- ``artifact``: ``Artifact``.
"""

from runs.models.artifact import Artifact
from runs.models.escalation import OPEN_ESCALATION_STATES, EscalationTicket
from runs.models.hierarchy import (
    DONE_NODE_STATES,
    LIVE_NODE_STATES,
    Agent,
    HierarchyNode,
    NodeStatus,
    Step,
    StepAttempt,
    Task,
)
from runs.models.pipeline import ApprovalRequest, ContextPin, DriftRecord, GateReceipt, PhaseRecord, PipelineKey
from runs.models.run import (
    ACTIVE_RUN_STATES,
    IN_FLIGHT_RUN_STATES,
    LIVE_RUN_STATES,
    MAX_RETRIES_PER_LEVEL,
    NOT_STARTED_RUN_STATES,
    SETTLED_RUN_STATES,
    TERMINAL_RUN_STATES,
    FailureMode,
    ParallelismMode,
    Run,
    RunAttempt,
    RunQuerySet,
)

__all__ = [
    "ACTIVE_RUN_STATES",
    "DONE_NODE_STATES",
    "IN_FLIGHT_RUN_STATES",
    "LIVE_NODE_STATES",
    "LIVE_RUN_STATES",
    "MAX_RETRIES_PER_LEVEL",
    "NOT_STARTED_RUN_STATES",
    "OPEN_ESCALATION_STATES",
    "SETTLED_RUN_STATES",
    "TERMINAL_RUN_STATES",
    "Agent",
    "ApprovalRequest",
    "Artifact",
    "ContextPin",
    "DriftRecord",
    "EscalationTicket",
    "FailureMode",
    "GateReceipt",
    "HierarchyNode",
    "NodeStatus",
    "ParallelismMode",
    "PhaseRecord",
    "PipelineKey",
    "Run",
    "RunAttempt",
    "RunQuerySet",
    "Step",
    "StepAttempt",
    "Task",
]
