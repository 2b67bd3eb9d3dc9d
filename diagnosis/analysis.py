"""What the diagnosis jobs compute: reads only, from the rows the engine wrote.

``failure_facts`` explains one failed step attempt: the error's class and whether it was
retryable, what the engine did (its tries, the waits between them, how the failure
propagated step → task → agent → run by each level's failure mode), similar failures of the
organization in the last 24 hours, and the runbook that applies. ``suggestion_compute`` picks
the next action on a run from its state, its credits, its gates, its heartbeat and its last
error. Both return JSON-able facts and a text made from them; nothing here writes a row.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Sum
from django.utils import timezone

from core.runbooks import runbook_get
from core.timefmt import isoformat_or_none
from jobs.registry import BACKOFF_CAP_MS, backoff_uncapped_ms
from runs.events import RUN_REPLANNED
from runs.models import (IN_FLIGHT_RUN_STATES, MAX_RETRIES_PER_LEVEL, Agent, ApprovalRequest, EscalationTicket,
                         FailureMode, NodeStatus, Run, Step, StepAttempt, Task)
from runs.substates import StatusReason, SubState

SIMILAR_WINDOW = timedelta(hours=24)
SIMILAR_LISTED = 10  # run ids and project names listed at most
RECURRING_THRESHOLD = 5  # this many similar failures in the window: escalate as well

# Error classes: (class, label, retryable by nature). Codes are matched exactly, then by prefix.
ERROR_CLASSES: dict[str, tuple[str, str]] = {
    "drill_retryable": ("transient", "transient tool error (drill)"),
    "retryable_error": ("transient", "transient tool error"),
    "connection_error": ("transient", "network error"),
    "http_429": ("transient", "rate limited (HTTP 429)"),
    "http_502": ("transient", "bad gateway (HTTP 502)"),
    "http_503": ("transient", "service unavailable (HTTP 503)"),
    "http_504": ("transient", "gateway timeout (HTTP 504)"),
    "tool_timeout": ("timeout", "tool timed out"),
    "drill_fatal": ("permanent", "permanent tool error (drill)"),
    "fatal_error": ("permanent", "permanent tool error"),
    "response_too_large": ("permanent", "response too large"),
    "unknown_tool": ("configuration", "unknown tool in the plan"),
    "unknown_gate_kind": ("configuration", "unknown gate kind in the plan"),
    "host_not_allowed": ("configuration", "host not allow-listed"),
    "no_project": ("configuration", "tool needs a project"),
    "validation_error": ("configuration", "invalid tool arguments"),
    "command_conflict": ("configuration", "idempotency key reused with other arguments"),
    "credit_limit_exceeded": ("credits", "credit limit of the attempt exceeded"),
    "heartbeat_timeout": ("infrastructure", "worker heartbeat lost"),
    "worker_lost": ("infrastructure", "worker lost"),
    "force_failed": ("operator", "force-failed by an operator"),
    "no_agent_completed": ("propagated", "every agent failed or was skipped"),
}
ERROR_PREFIXES: list[tuple[str, tuple[str, str]]] = [
    ("gate_failed:", ("gate", "internal gate check failed")),
    ("http_4", ("permanent", "client error")),
    ("http_5", ("transient", "server error")),
    ("stopped_drift:", ("gate", "context drift")),
]
RUN_TIMEOUT_SUFFIX = "_timeout"

# Runbook actions (seed 001 §9) an explanation or a suggestion may name: the registered runbook of
# that name on runs (or on escalation tickets); its title, command and admin button come from it.
RUNBOOK_MODELS = {"acknowledge": EscalationTicket}
# Advice that is not a runbook on a run or a ticket.
ADVICE: dict[str, dict[str, str]] = {
    "topup": {"title": "Top up credits",
              "command": "python manage.py topup_credits {organization} --amount {amount} --reason \"...\""},
    "wait": {"title": "Wait", "command": ""},
    "none": {"title": "Nothing to do", "command": ""},
}


# How a suggestion's text starts, per action ("retry: retryable error ...").
SUGGESTION_PHRASES = {
    "retry": "retry", "recover": "recover stuck run", "force_fail": "force fail", "refund": "refund",
    "escalate": "escalate", "approve_gate": "approve gate", "resume": "resume", "topup": "top up credits",
    "start": "start", "acknowledge": "acknowledge escalation", "wait": "wait", "none": "nothing to do",
}


def error_class(code: str, retryable: bool | None = None) -> dict[str, Any]:
    """``{"code", "class", "label", "retryable"}`` for an error code (``retryable``: as recorded)."""
    code = code or ""
    found = ERROR_CLASSES.get(code)
    if found is None:
        found = next((value for prefix, value in ERROR_PREFIXES if code.startswith(prefix)), None)
    if found is None and code.endswith(RUN_TIMEOUT_SUFFIX):
        found = ("infrastructure", f"run state timed out ({code})")
    if found is None:
        found = ("transient", "transient error") if retryable else ("permanent", "error")
    klass, label = found
    if retryable is None:
        retryable = klass in ("transient", "timeout", "infrastructure")
    return {"code": code, "class": klass, "label": label, "retryable": bool(retryable)}


def runbook(action: str, why: str, **values: Any) -> dict[str, str]:
    """What to do and how: ``{"action", "title", "why", "command"}``, and ``"admin"`` (the button's
    page) when the object is known."""
    values = {"run": "", "amount": "N", "gate": "GATE", "organization": "ORG", "ticket": "", **values}
    advice = ADVICE.get(action)
    if advice is not None:
        command = advice["command"].format(**values) if advice["command"] else ""
        return {"action": action, "title": advice["title"], "why": why, "command": command}
    book = runbook_get(RUNBOOK_MODELS.get(action, Run), action)
    target = values["ticket"] if book.model is EscalationTicket else values["run"]
    entry = {"action": action, "title": book.title, "why": why, "command": book.command_line(target, **values)}
    if target != "":
        entry["admin"] = book.admin_url(target)
    return entry


def _ms(delta: timedelta | None) -> int | None:
    return None if delta is None else max(0, int(delta.total_seconds() * 1000))



def backoff_schedule_ms(max_tries: int) -> list[int]:
    """Seed 001 §6.1's nominal waits before tries 2, 3 ... (±10 % jitter in practice)."""
    return [min(backoff_uncapped_ms(retry), BACKOFF_CAP_MS) for retry in range(1, max(1, max_tries))]


# --- explaining a failed step attempt ------------------------------------------------------

def engine_decision(attempt: StepAttempt, step: Step) -> dict[str, Any]:
    """What the engine decided about ``attempt``, read from the step as it is now.

    Exact right after the failure (the services decide in the failing transaction); later, a
    newer attempt of the step may have replaced it, which is said so.
    """
    current = step.attempts == attempt.number
    if current and step.status in (NodeStatus.PENDING, NodeStatus.PAUSED) and step.not_before is not None:
        return {"decision": "retry", "try": step.tries_this_round, "max_tries": step.max_tries,
                "retry_in_ms": _ms(step.not_before - attempt.finished_at) if attempt.finished_at else None}
    if current and step.status == NodeStatus.FAILED:
        return {"decision": "failed", "try": step.tries_this_round, "max_tries": step.max_tries}
    if current and step.status in (NodeStatus.PENDING, NodeStatus.PAUSED):
        return {"decision": "level_retry", "max_tries": step.max_tries}
    if not current:
        return {"decision": "superseded", "max_tries": step.max_tries, "later_attempts": step.attempts - attempt.number}
    return {"decision": step.status, "max_tries": step.max_tries}


def _tries(step: Step, attempt: StepAttempt) -> list[dict[str, Any]]:
    """Every attempt of the step up to this one, with the wait before each (from the rows)."""
    rows = list(StepAttempt.objects.filter(step=step, number__lte=attempt.number).order_by("number").only(
        "number", "outcome", "retryable", "error_code", "cost", "started_at", "finished_at"))
    tries = []
    previous = None
    for row in rows:
        waited = None
        if previous is not None and previous.finished_at is not None:
            waited = _ms(row.started_at - previous.finished_at)
        tries.append({"number": row.number, "outcome": row.outcome, "error_code": row.error_code,
                      "retryable": row.retryable, "cost": row.cost, "waited_ms": waited,
                      "duration_ms": _ms(row.finished_at - row.started_at) if row.finished_at else None})
        previous = row
    return tries


def _level(level: str, node, *, effect: str, **extra) -> dict[str, Any]:
    name = str(node.pk) if isinstance(node, Run) else node.name
    entry = {"level": level, "name": name, "status": node.status, "effect": effect}
    failure_mode = getattr(node, "failure_mode", None)
    if failure_mode:
        entry["failure_mode"] = failure_mode
    retry_count = getattr(node, "retry_count", None)
    if retry_count:
        entry["retry_count"] = retry_count
    entry.update(extra)
    return entry


def propagation(*, decision: dict, attempt: StepAttempt, step: Step, task: Task, agent: Agent,
                run: Run) -> list[dict[str, Any]]:
    """How the failure travelled step → task → agent → run, by each level's failure mode and status."""
    transient = bool(attempt.retryable)
    if decision["decision"] == "retry":
        delay = decision.get("retry_in_ms")
        wait = f" after ~{delay} ms" if delay is not None else ""
        return [_level("step", step, effect=f"retried{wait} (try {decision['try']} of {decision['max_tries']} "
                                            f"failed); nothing propagated")]
    if decision["decision"] == "superseded" and step.status != NodeStatus.FAILED:
        return [_level("step", step, effect=f"ran again ({decision['later_attempts']} later attempt(s)); "
                                            f"now {step.status}")]
    chain = [_level("step", step, effect=f"failed ({'retryable, tries exhausted' if transient else 'not retryable'})"
                    if step.status == NodeStatus.FAILED or decision["decision"] == "failed"
                    else f"reset for a retry of its task ({step.status})")]
    for level, node in (("task", task), ("agent", agent)):
        mode = node.failure_mode
        if mode == FailureMode.CONTINUE:
            chain.append(_level(level, node, effect="continued past the failure (continue); nothing propagated"))
            return chain
        if node.status != NodeStatus.FAILED and mode == FailureMode.RETRY and node.retry_count:
            chain.append(_level(level, node, effect=f"retried from the start ({node.retry_count} of "
                                                    f"{MAX_RETRIES_PER_LEVEL} retries used); nothing propagated"))
            return chain
        if node.status != NodeStatus.FAILED:
            chain.append(_level(level, node, effect=f"not failed ({node.status})"))
            return chain
        why = "fail-fast" if mode == FailureMode.FAIL_FAST else (
            "retry budget spent" if transient else "retry mode, but the error is not transient")
        chain.append(_level(level, node, effect=f"failed ({why})"))
    failing_attempt = agent.attempt_number
    replan = _replan_of(run, agent)
    if replan is not None:
        chain.append(_level("run", run, effect=f"replanned instead of failing (replan {replan['replan_count']}): new "
                                               f"agents {', '.join(replan['new_agents'])}; now {run.status}",
                            failure_mode=run.failure_mode))
    elif run.failure_mode == FailureMode.CONTINUE:
        chain.append(_level("run", run, effect="continues with its other agents (continue)",
                            failure_mode=run.failure_mode))
    elif run.attempt_number > failing_attempt:
        chain.append(_level("run", run, effect=f"failed attempt {failing_attempt}, then retried as attempt "
                                               f"{run.attempt_number} of {run.max_attempts} ({run.status})",
                            failure_mode=run.failure_mode))
    elif run.status == Run.Status.FAILED:
        chain.append(_level("run", run, effect=f"failed with {run.last_error_code or '?'}; unused credits released "
                                               f"({run.credits_refunded} refunded, {run.credits_charged} charged)",
                            failure_mode=run.failure_mode))
    elif run.status in (Run.Status.PAUSED, Run.Status.RESUMING):
        chain.append(_level("run", run, effect="paused: the failure applies when it resumes",
                            failure_mode=run.failure_mode))
    else:
        chain.append(_level("run", run, effect=f"now {run.status}", failure_mode=run.failure_mode))
    return chain


def _replan_of(run: Run, agent: Agent) -> dict | None:
    """The re-plan (seed 001 §6.4) that took over the failed agent's work, if there was one."""
    from core.models import Event

    if not run.replan_count:
        return None
    for payload in Event.objects.filter(run_id=run.pk, type=RUN_REPLANNED).values_list("payload", flat=True):
        if agent.name in (payload.get("failed_agents") or []):
            return payload
    return None


def escalations_open(run: Run) -> list[dict[str, Any]]:
    """The run's escalation tickets not resolved yet (seed 001 §6.2: the engine opens them)."""
    return list(EscalationTicket.objects.filter(run=run).exclude(status=EscalationTicket.Status.RESOLVED)
                .order_by("id").values("id", "trigger", "status"))


def similar_failures(*, organization_id: int, code: str, exclude_attempt_id: int, now=None) -> dict[str, Any]:
    """Failed step attempts with the same code in the organization's 24 hours up to ``now`` (the
    failure's time, so that computing an explanation again gives the same answer)."""
    now = now or timezone.now()
    queryset = (StepAttempt.objects.filter(run__organization_id=organization_id, error_code=code,
                                           outcome=StepAttempt.Outcome.FAILED, finished_at__gte=now - SIMILAR_WINDOW,
                                           finished_at__lte=now)
                .exclude(pk=exclude_attempt_id))
    by_run = list(queryset.values("run_id", "run__project__name").annotate(n=Count("pk")).order_by("-run_id"))
    projects = sorted({row["run__project__name"] for row in by_run})
    return {"window_hours": int(SIMILAR_WINDOW.total_seconds() // 3600), "code": code,
            "count": sum(row["n"] for row in by_run), "runs": len(by_run),
            "run_ids": [row["run_id"] for row in by_run[:SIMILAR_LISTED]],
            "projects": projects[:SIMILAR_LISTED], "project_count": len(projects)}


def failed_attempts_cost(run: Run) -> int:
    return StepAttempt.objects.filter(run=run, outcome=StepAttempt.Outcome.FAILED).aggregate(
        total=Sum("cost"))["total"] or 0


def _explanation_runbook(*, error: dict, decision: dict, run: Run, similar: dict) -> list[dict[str, str]]:
    from runs.selectors import runs_heartbeat_stale

    books: list[dict[str, str]] = []
    klass = error["class"]
    if decision["decision"] == "retry":
        books.append(runbook("wait", "the engine retries the step by itself"))
    elif run.status == Run.Status.FAILED:
        if klass == "credits":
            books.append(runbook("topup", f"the attempt ran out of its {run.credit_limit} reserved credits; add "
                                          "credits (or raise the run's credit limit in a new run), then retry",
                                 organization=run.organization_id))
            if run.has_attempts_left():
                books.append(runbook("retry", "after the top-up", run=run.pk))
        elif error["retryable"] and run.has_attempts_left():
            books.append(runbook("retry", f"transient error and {run.max_attempts - run.attempt_number} attempt(s) "
                                          "left", run=run.pk))
        elif error["retryable"]:
            books.append(runbook("escalate", f"transient error but all {run.max_attempts} attempts are spent",
                                 run=run.pk))
        elif klass == "configuration":
            cost = failed_attempts_cost(run)
            if cost and run.credits_charged:
                books.append(runbook("refund", f"the plan cannot run as written; {min(cost, run.credits_charged)} "
                                               "credits were charged for failed attempts",
                                     run=run.pk, amount=min(cost, run.credits_charged)))
            books.append(runbook("escalate", "fix the plan and create a new run", run=run.pk))
        else:
            books.append(runbook("escalate", "permanent error: retrying will fail the same way", run=run.pk))
    elif run.status == Run.Status.RUNNING and runs_heartbeat_stale().filter(pk=run.pk).exists():
        books.append(runbook("recover", "the run is running but its worker is silent", run=run.pk))
    elif run.status in IN_FLIGHT_RUN_STATES:
        books.append(runbook("wait", f"the failure was contained; the run is {run.status}"))
    else:
        books.append(runbook("none", f"the run is {run.status}"))
    if similar["count"] + 1 >= RECURRING_THRESHOLD and not any(book["action"] == "escalate" for book in books):
        books.append(runbook("escalate", f"recurring: {similar['count'] + 1} failures with {error['code']} in "
                                         f"{similar['window_hours']} h", run=run.pk))
    return books


def failure_facts(*, attempt_id: int, decision: dict | None = None, now=None) -> dict[str, Any]:
    """Everything an explanation says about one failed step attempt, as JSON-able facts."""
    attempt = StepAttempt.objects.select_related("run", "step__task__agent").get(pk=attempt_id)
    step, run = attempt.step, attempt.run
    task, agent = step.task, step.task.agent
    decision = decision or engine_decision(attempt, step)
    error = error_class(attempt.error_code, attempt.retryable)
    tries = _tries(step, attempt)
    similar = similar_failures(organization_id=run.organization_id, code=attempt.error_code,
                               exclude_attempt_id=attempt.pk, now=now or attempt.finished_at)
    return {
        "run": run.pk,
        "run_attempt": agent.attempt_number,
        "step": {"id": step.pk, "name": step.name, "kind": step.kind, "tool": step.tool, "task": task.name,
                 "agent": agent.name},
        "attempt": {"number": attempt.number, "cost": attempt.cost, "started_at": isoformat_or_none(attempt.started_at),
                    "finished_at": isoformat_or_none(attempt.finished_at),
                    "duration_ms": _ms(attempt.finished_at - attempt.started_at) if attempt.finished_at else None},
        "error": {**error, "message": attempt.error[:500]},
        "engine": {**decision, "tries": tries, "backoff_schedule_ms": backoff_schedule_ms(step.max_tries)},
        "propagation": propagation(decision=decision, attempt=attempt, step=step, task=task, agent=agent, run=run),
        "escalations": escalations_open(run),
        "similar": similar,
        "runbooks": _explanation_runbook(error=error, decision=decision, run=run, similar=similar),
    }


def failure_text(facts: dict[str, Any]) -> str:
    """The explanation as a few lines of plain text, made from ``facts`` only."""
    error, engine, step = facts["error"], facts["engine"], facts["step"]
    lines = [f"{error['code'] or 'error'}: {error['label']}, {'retryable' if error['retryable'] else 'not retryable'}"
             f" — {error['message']}" if error["message"] else
             f"{error['code'] or 'error'}: {error['label']}, {'retryable' if error['retryable'] else 'not retryable'}"]
    tries = engine["tries"]
    waits = [f"{entry['waited_ms']} ms" for entry in tries if entry["waited_ms"] is not None]
    failed = sum(1 for entry in tries if entry["outcome"] == StepAttempt.Outcome.FAILED)
    schedule = ", ".join(str(delay) for delay in engine["backoff_schedule_ms"])
    engine_line = (f"Engine: step {step['name']} (task {step['task']}, agent {step['agent']}, run attempt "
                   f"{facts['run_attempt']}), attempt {facts['attempt']['number']}: {failed} of {len(tries)} "
                   f"attempt(s) so far failed, up to {engine['max_tries']} tries per round")
    if waits:
        engine_line += f"; waited {', '.join(waits)} between tries (backoff {schedule} ms ±10 %)"
    lines.append(engine_line + ".")

    def hop(entry: dict) -> str:
        mode = f" ({entry['failure_mode']})" if entry.get("failure_mode") else ""
        return f"{entry['level']} {entry['name']}{mode}: {entry['effect']}"

    lines.append("Propagation: " + " → ".join(hop(entry) for entry in facts["propagation"]) + ".")
    if facts.get("escalations"):
        tickets = (f"ticket {ticket['id']} ({ticket['trigger']}, {ticket['status']})"
                   for ticket in facts["escalations"])
        lines.append("Escalations open on the run: " + ", ".join(tickets) + ".")
    similar = facts["similar"]
    if similar["count"]:
        lines.append(f"Similar: {similar['count']} other failure(s) with {similar['code']} in the last "
                     f"{similar['window_hours']} h, in {similar['runs']} run(s) "
                     f"({', '.join('#' + str(run_id) for run_id in similar['run_ids'])}) of "
                     f"{similar['project_count']} project(s) ({', '.join(similar['projects'])}).")
    else:
        lines.append(f"Similar: no other failure with {similar['code'] or 'this code'} in the last "
                     f"{similar['window_hours']} h.")
    books = facts["runbooks"]
    lines.append("Runbook: " + "; then ".join(
        f"{book['action']} — {book['why']}{' (' + book['command'] + ')' if book['command'] else ''}" for book in books)
                 + ".")
    return "\n".join(lines)


# --- suggesting the next action on a run ---------------------------------------------------

def run_version(run: Run) -> str:
    """A digest of what an operator's next action depends on: status, attempt, credits, error."""
    state = [run.status, run.status_reason, run.attempt_number, run.max_attempts, run.credits_reserved,
             run.credits_charged, run.credits_refunded, run.last_error_code, run.replan_count,
             isoformat_or_none(run.deleted_at)]
    return hashlib.sha256(json.dumps(state, default=str).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class SuggestionResult:
    action: str
    text: str
    facts: dict[str, Any]


def _last_step_failure(run: Run) -> StepAttempt | None:
    return (StepAttempt.objects.filter(run=run, outcome=StepAttempt.Outcome.FAILED,
                                       step__task__agent__attempt_number=run.attempt_number)
            .order_by("-finished_at", "-id").first())


def _heartbeat_age_s(run: Run, now) -> int | None:
    seen = run.last_heartbeat or run.status_changed_at
    return None if seen is None else int((now - seen).total_seconds())


def suggestion_compute(*, run_id: int, now=None) -> SuggestionResult:
    """The next action an operator should take on the run, and the facts it rests on."""
    from billing.selectors import account_balance
    from jobs.models import Job, JobState
    from runs.selectors import runs_heartbeat_stale

    now = now or timezone.now()
    run = Run.objects.get(pk=run_id)
    available = account_balance(organization_id=run.organization_id)["available"]
    escalations = list(EscalationTicket.objects.filter(run=run).exclude(status=EscalationTicket.Status.RESOLVED)
                       .order_by("id").values("id", "trigger", "status"))
    unacknowledged = [ticket for ticket in escalations if ticket["status"] == EscalationTicket.Status.OPEN]
    steps = Step.objects.filter(run=run, task__agent__attempt_number=run.attempt_number)
    facts: dict[str, Any] = {
        "run": run.pk, "status": run.status, "status_reason": run.status_reason, "attempt": run.attempt_number,
        "max_attempts": run.max_attempts, "attempts_left": run.max_attempts - run.attempt_number,
        "credit_limit": run.credit_limit, "available_credits": available, "credits_reserved": run.credits_reserved,
        "credits_charged": run.credits_charged, "credits_refunded": run.credits_refunded,
        "open_escalations": escalations, "run_version": run_version(run),
        "steps": {"total": steps.count(), "done": steps.filter(status=NodeStatus.COMPLETED).count()},
    }
    if run.last_error_code:
        failure = _last_step_failure(run)
        recorded = failure.retryable if failure is not None and failure.error_code == run.last_error_code else None
        facts["last_error"] = {**error_class(run.last_error_code, recorded), "message": run.last_error[:500]}

    def done(action: str, text: str, **more) -> SuggestionResult:
        facts.update(more)
        facts["runbook"] = runbook(action, text, run=run.pk, organization=run.organization_id,
                                   amount=more.get("amount", "N"), gate=more.get("gate", "GATE"),
                                   ticket=more.get("ticket", ""))
        phrase = SUGGESTION_PHRASES[action] + (f" {more['gate']}" if action == "approve_gate" else "")
        return SuggestionResult(action, f"{phrase}: {text}", facts)

    status = run.status
    if run.deleted_at is not None:
        return done("none", "run deleted")
    if status == Run.Status.COMPLETED:
        return done("none", f"run completed ({run.credits_charged} credits charged, {run.credits_refunded} released)")
    if status == Run.Status.CANCELLED:
        return done("none", f"run cancelled ({run.credits_charged} credits charged, {run.credits_refunded} released)")
    if status == Run.Status.CREATED:
        if available < run.credit_limit:
            return done("topup", f"starting needs {run.credit_limit} credits, only {available} available",
                        amount=run.credit_limit - available)
        return done("start", f"never started; {run.credit_limit} credits to reserve, {available} available")
    if status == Run.Status.PAUSED:
        if StatusReason.parse(run.status_reason).is_(SubState.AWAITING_APPROVAL):
            gate = run.status_reason.split(":", 1)[1]
            request = (ApprovalRequest.objects.filter(run=run, gate=gate, status=ApprovalRequest.Status.PENDING)
                       .order_by("-id").first())
            since = f", waiting {int((now - request.requested_at).total_seconds())} s" if request else ""
            return done("approve_gate", f"the run waits for it{since}", gate=gate)
        paused_for = int((now - run.status_changed_at).total_seconds()) if run.status_changed_at else None
        why = f" ({run.status_reason})" if run.status_reason else ""
        held = run.credits_reserved - run.credits_charged - run.credits_refunded
        return done("resume", f"paused{why} for {paused_for if paused_for is not None else '?'} s; "
                              f"{held} reserved credits held")
    if status == Run.Status.RUNNING:
        age = _heartbeat_age_s(run, now)
        facts["heartbeat_age_s"] = age
        if runs_heartbeat_stale().filter(pk=run.pk).exists():
            return done("recover", f"heartbeat silent {age} s (timeout "
                                   f"{settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S} s)")
    if status in IN_FLIGHT_RUN_STATES:
        waiting = Job.objects.filter(run_id=run.pk, state__in=[JobState.QUEUED, JobState.AWAITING_TOOL]).count()
        facts["jobs_waiting"] = waiting
        if unacknowledged:
            ticket = unacknowledged[0]
            return done("acknowledge", f"escalation {ticket['id']} ({ticket['trigger']}) is open", ticket=ticket["id"])
        progress = f"{facts['steps']['done']} of {facts['steps']['total']} steps done"
        return done("wait", f"run {status}, {progress}, {waiting} job(s) waiting for a worker")
    # failed
    error = facts.get("last_error") or error_class("", None)
    code = error["code"] or "unknown error"
    if run.has_attempts_left() and error["class"] == "credits":
        return done("topup", f"{code}: the attempt needed more than its {run.credit_limit} credits",
                    amount=run.credit_limit)
    if run.has_attempts_left() and error["retryable"]:
        left = run.max_attempts - run.attempt_number
        if available < run.credit_limit:
            return done("topup", f"retryable error {code}, {left} attempt(s) left, but a retry reserves "
                                 f"{run.credit_limit} credits and only {available} are available",
                        amount=run.credit_limit - available)
        return done("retry", f"retryable error {code}, {left} attempt(s) left, {available} credits available")
    wasted = min(failed_attempts_cost(run), run.credits_charged)
    if wasted and error["class"] in ("configuration", "infrastructure", "credits", "propagated", "operator"):
        return done("refund", f"{wasted} credits charged for failed attempts ({code})", amount=wasted)
    if unacknowledged:
        ticket = unacknowledged[0]
        return done("acknowledge", f"escalation {ticket['id']} ({ticket['trigger']}) is open", ticket=ticket["id"])
    if escalations:
        ticket = escalations[0]
        return done("wait", f"escalation {ticket['id']} ({ticket['trigger']}) is {ticket['status']}: its resolution "
                            "decides what comes next")
    reason = "attempts exhausted" if not run.has_attempts_left() else "not retryable"
    return done("escalate", f"{code} ({error['label']}), {reason} ({run.attempt_number} of {run.max_attempts})")
