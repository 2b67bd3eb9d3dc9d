"""The only writers of runs and their hierarchy.

One service per transition. Each opens a transaction, locks the run row
(``select_for_update``), re-checks the state, calls the django-fsm-2 transition, writes the
ledger entries, the event row and (for operator actions) the audit row, and saves. Every
service that touches an agent, a task or a step locks the run first, so the run row
serializes all writers of one run (lock order: run → job → credit account).

Repeating a transition into the state the run is already in is a no-op (seed 001 §1.3);
any other forbidden transition raises ``InvalidTransition`` naming the run, its state and the
requested action, and changes nothing.

The package by concern:

- ``common``: What every run service shares: the run's row lock, the before/after snapshot and its audit and
- ``credits``: A run's credits: the reservation of an attempt, step charges (exactly once per idempotency key),
- ``settlement``: How a run ends from inside the engine: completed, failed (or failed later, when paused), retried.
- ``propagation``: Failure and completion propagation up the hierarchy: step → task → agent → run, by each level's
- ``lifecycle``: The run lifecycle services: create, start, mark running, heartbeat, complete, fail, recover, pause,
- ``steps``: Step attempts and scheduling: which steps are runnable, a step attempt's begin, its success,
"""

from runs.errors import (  # noqa: F401
    ApprovalNotPending,
    ApprovalRequired,
    ApprovalReused,
    DriftDetected,
    DriftNotPending,
    RunNotStuck,
)
from runs.services.common import (  # noqa: F401
    RUN_DISPATCHERS,
    STEP_FAILURE_HOOKS,
    _lock_run,
)
from runs.services.credits import run_refund  # noqa: F401
from runs.services.lifecycle import (  # noqa: F401
    HEARTBEAT_TIMEOUT_CODE,
    run_cancel,
    run_complete,
    run_create,
    run_delete,
    run_fail,
    run_heartbeat,
    run_mark_running,
    run_pause,
    run_recover,
    run_requeue,
    run_resume,
    run_retry,
    run_start,
    run_void,
)
from runs.services.steps import (  # noqa: F401
    HEARTBEAT_REUSE,
    StepOutcome,
    heartbeat_record,
    heartbeat_reuse,
    runnable_steps,
    step_attempt_abandon,
    step_attempt_fail,
    step_attempt_succeed,
    step_backoff_ms,
    step_begin,
    step_begin_locked,
)
from runs.services.approvals import approval_grant  # noqa: F401
from runs.services.drift import (  # noqa: F401
    ResumeResult,
    drift_acknowledge,
    pipeline_resume,
    recovery_revalidate,
)
from runs.services.escalations import (  # noqa: F401
    escalation_acknowledge,
    escalation_add_detail,
    escalation_open,
    escalation_resolve,
    escalations_evaluate,
)
from runs.services.caps import caps_enforce, runs_caps_enforce  # noqa: F401
from runs.services.tree import run_tree_handed_over  # noqa: F401
