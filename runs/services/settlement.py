"""How a run ends from inside the engine: completed, failed (or failed later, when paused), retried.
The lifecycle services and failure propagation both end runs through these, under the run's lock.
"""

from __future__ import annotations

from django.conf import settings
from django.utils import timezone

from core.errors import (
    InvalidTransition,
)
from runs.models import (
    LIVE_NODE_STATES,
    Agent,
    NodeStatus,
    Run,
    RunAttempt,
)
from runs.plan import plan_diff
from runs.services.common import (
    _apply,
    _close_attempt,
    _current_attempt,
    _dispatch,
    _duration_ms,
    _record_run_change,
    _run_tree,
    _snapshot,
    _terminate_live_nodes,
)
from runs.services.credits import _reserve, _settle


def _defer_failure_while_paused(run: Run, *, code: str) -> None:
    """A paused run cannot fail: note the agent failure on the open attempt (its ``error_code``,
    overwritten when the attempt closes); ``run_mark_running`` applies it when the run resumes."""
    attempt = _current_attempt(run)
    if attempt is not None and not attempt.outcome:
        attempt.error_code = code
        attempt.save(update_fields=["error_code"])


def _complete_locked(run: Run, *, actor=None, reason: str = "") -> Run:
    before = _snapshot(run)
    _apply(run, "complete")
    statuses = [agent.status for agent in _run_tree(run).agents.values()]
    if any(s in LIVE_NODE_STATES for s in statuses) or NodeStatus.COMPLETED not in statuses:
        raise InvalidTransition(entity="run", entity_id=run.pk, current=before["status"], requested="complete",
                                why="not every agent is done with at least one completed")
    attempt = _current_attempt(run)
    _settle(run, attempt, actor=actor, reason=reason, save=False)
    now = timezone.now()
    run.completed_at = now
    run.duration_ms = _duration_ms(run, now)
    run.status_reason = ""
    closed = _close_attempt(run, attempt, outcome=Run.Status.COMPLETED, save=False)
    _record_run_change(run, before=before, action="complete", actor=actor, reason=reason, with_rows=closed)
    return run


def _fail_locked(run: Run, *, code: str, message: str, actor=None, reason: str = "", action: str = "fail") -> Run:
    before = _snapshot(run)
    _apply(run, "fail")
    attempt = _current_attempt(run)
    _terminate_live_nodes(run, attempt_number=run.attempt_number)
    _settle(run, attempt, actor=actor, reason=reason, save=False)
    now = timezone.now()
    run.last_error_code = code
    run.last_error = message
    run.completed_at = now
    run.duration_ms = _duration_ms(run, now)
    closed = _close_attempt(run, attempt, outcome=Run.Status.FAILED, error_code=code, save=False)
    _record_run_change(run, before=before, action=action, actor=actor, reason=reason, with_rows=closed)
    return run


def _retry_locked(run: Run, *, actor=None, reason: str = "", plan: dict | None = None) -> Run:
    """A new attempt; with ``plan`` (already validated), the attempt runs that plan instead, and the
    audit record keeps the plan before and after and the paths that changed."""
    before = _snapshot(run)
    _apply(run, "retry")
    audit_after = None
    if plan is not None and plan != run.plan:
        before["plan"] = run.plan
        audit_after = {"plan": plan, "plan_diff": plan_diff(run.plan, plan)}
        run.plan = plan
        run.max_agents = plan.get("max_agents", settings.ORCHESTRATOR_MAX_AGENTS)
    attempt = RunAttempt(run=run, number=run.attempt_number)  # inserted with its reservation
    _reserve(run, attempt, actor=actor, reason=reason)
    run.status_reason = ""
    _record_run_change(run, before=before, action="retry", actor=actor, reason=reason, audit_after=audit_after)
    _dispatch(run)
    return run

