"""Reads of runs for operators: stuck runs, escalated runs, per-run timelines.

The thresholds are the run timeouts of DESIGN §2.1 (``ORCHESTRATOR_RUN_*_TIMEOUT_S``), read
when called, so the admin filter, the recovery runbook and the reaper agree on "stuck".
"""

from __future__ import annotations

from collections import defaultdict
from datetime import timedelta

from django.conf import settings
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from jobs.models import Job, JobState
from runs.models import Agent, EscalationTicket, GateReceipt, Run, RunAttempt, Step, Task


def _work_waiting_in_queue() -> Exists:
    """The run has a job waiting for a worker: silence is the queue's, not a lost worker's."""
    return Exists(Job.objects.filter(run_id=OuterRef("pk"), state__in=[JobState.RECEIVED, JobState.QUEUED,
                                                                          JobState.AWAITING_TOOL]))


def run_heartbeat_stale_q(*, older_than_s: int | None = None, now=None) -> Q:
    """Running, and no worker heartbeat for ``older_than_s`` (default: the heartbeat timeout)."""
    now = now or timezone.now()
    seconds = settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S if older_than_s is None else older_than_s
    cutoff = now - timedelta(seconds=seconds)
    silent = Q(last_heartbeat__lt=cutoff) | Q(last_heartbeat__isnull=True, status_changed_at__lt=cutoff)
    return Q(status=Run.Status.RUNNING) & silent & ~Q(_work_waiting_in_queue())


def runs_heartbeat_stale(*, older_than_s: int | None = None, now=None) -> QuerySet:
    """Runs for the stuck-run runbook (seed 001 §9.1): running with a silent worker."""
    return Run.objects.filter(run_heartbeat_stale_q(older_than_s=older_than_s, now=now)).order_by("id")


def run_stuck_q(*, now=None) -> Q:
    """A silent running run, or a run in pending, running, paused, resuming or retrying for longer
    than that state's timeout."""
    now = now or timezone.now()

    def before(seconds: int):
        return now - timedelta(seconds=seconds)

    too_long = (
        Q(status=Run.Status.PENDING, status_changed_at__lt=before(settings.ORCHESTRATOR_RUN_PENDING_TIMEOUT_S))
        | Q(status=Run.Status.RUNNING, started_at__lt=before(settings.ORCHESTRATOR_RUN_RUNNING_TIMEOUT_S))
        | Q(status=Run.Status.PAUSED, status_changed_at__lt=before(settings.ORCHESTRATOR_RUN_PAUSED_TIMEOUT_S))
        | Q(status=Run.Status.RESUMING, status_changed_at__lt=before(settings.ORCHESTRATOR_RUN_RESUMING_TIMEOUT_S))
        | Q(status=Run.Status.RETRYING, status_changed_at__lt=before(settings.ORCHESTRATOR_RUN_RETRYING_TIMEOUT_S))
    )
    return run_heartbeat_stale_q(now=now) | too_long


def run_escalated() -> Exists:
    """An annotation/filter: the run has an escalation ticket that is not resolved."""
    return Exists(EscalationTicket.objects.filter(run_id=OuterRef("pk")).exclude(
        status=EscalationTicket.Status.RESOLVED))


def run_open_escalation(*, run: Run) -> EscalationTicket | None:
    """The run's one open or acknowledged escalation ticket (its current incident), if any."""
    return EscalationTicket.objects.filter(run=run).exclude(status=EscalationTicket.Status.RESOLVED).first()


def run_held_credits(run: Run) -> int:
    """Credits reserved for the run and neither charged nor released yet."""
    return run.credits_reserved - run.credits_charged - run.credits_refunded


def run_step_jobs_queued(rounds: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """Of ``(step id, round)`` pairs, those an active ``run_step`` job already holds (its dedupe
    key): one indexed read instead of an enqueue each that the queue's dedupe would drop."""
    if not rounds:
        return set()
    keys = {f"run_step:{step}:{round_}": (step, round_) for step, round_ in rounds}
    return {keys[key] for key in Job.objects.filter(active_dedupe_key__in=list(keys)).values_list(
        "active_dedupe_key", flat=True)}


def run_current_attempt(run: Run) -> RunAttempt | None:
    """The run's current attempt (the one ``run.attempt_number`` names)."""
    return RunAttempt.objects.filter(run=run, number=run.attempt_number).first()


def run_last_passed_gate(run: Run) -> GateReceipt | None:
    """The last internal gate the run's current attempt passed (its step read with it)."""
    return (GateReceipt.objects.filter(run=run, attempt_number=run.attempt_number, kind=GateReceipt.Kind.GATE,
                                       passed=True).select_related("step").order_by("-finished_at", "-id").first())


def run_hierarchy(run: Run) -> tuple[list[Agent], dict[int, list[Task]], dict[int, list[Step]]]:
    """Every attempt's agents, tasks by agent id and steps by task id, in three queries whatever its size."""
    agents = list(Agent.objects.filter(run=run).only(
        "pk", "run_id", "attempt_number", "sequence", "name", "status", "parallelism_mode", "failure_mode",
        "retry_count", "last_error_code").order_by("attempt_number", "sequence", "pk"))
    tasks = defaultdict(list)
    for task in Task.objects.filter(run=run).only(
            "pk", "agent_id", "sequence", "name", "status", "parallelism_mode", "depends_on", "retry_count",
            "last_error_code").order_by("agent_id", "sequence", "pk"):
        tasks[task.agent_id].append(task)
    steps = defaultdict(list)
    for step in Step.objects.filter(run=run).only(
            "pk", "task_id", "sequence", "name", "kind", "tool", "status", "attempts", "credits_charged",
            "last_error_code", "last_error").order_by("task_id", "sequence", "pk"):
        steps[step.task_id].append(step)
    return agents, tasks, steps
