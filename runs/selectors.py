"""Reads of runs for operators: stuck runs, escalated runs, per-run timelines.

The thresholds are the run timeouts of DESIGN §2.1 (``ORCHESTRATOR_RUN_*_TIMEOUT_S``), read
when called, so the admin filter, the recovery runbook and the reaper agree on "stuck".
"""

from __future__ import annotations

from collections import defaultdict
from datetime import timedelta

from django.conf import settings
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.db.models.functions import Coalesce
from django.db.models.lookups import GreaterThanOrEqual, IsNull, LessThan
from django.utils import timezone

from core.fsm import moves_may_wait
from jobs.models import Job, JobState
from jobs.selectors import jobs_active_dedupe_keys
from runs.models import Agent, EscalationTicket, GateReceipt, Run, RunAttempt, Step, StepAttempt, Task


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


# The order that walks each part of ``run_stuck_parts`` along its index (none: a bitmap of several).
RUN_STUCK_PART_ORDERINGS = (("status", "status_changed_at"),) * 4 + (
    (Coalesce("last_heartbeat", "status_changed_at").asc(),),
    (Coalesce("last_heartbeat", "status_changed_at").asc(),),
    (Coalesce("last_heartbeat", "status_changed_at").asc(),), ())


def run_stuck_parts(*, now=None) -> list[Q]:
    """``run_stuck_q`` as disjoint conditions (a stuck run matches exactly one, another run none),
    each a range of one index, so that a stuck list or a bounded count reads only the runs it
    counts: a waiting status past its timeout (``(status, status_changed_at)``); running with a
    silent worker and no job waiting for one (the partial index of running runs by their last sign
    of life: the heartbeat, or the status change of a run that never beat); running, started before
    the running timeout, and either alive (the same index) or silent because its work waits in the
    queue (found from the few waiting jobs)."""
    now = now or timezone.now()

    def before(seconds: int):
        return now - timedelta(seconds=seconds)

    waiting = [(Run.Status.PENDING, settings.ORCHESTRATOR_RUN_PENDING_TIMEOUT_S),
               (Run.Status.PAUSED, settings.ORCHESTRATOR_RUN_PAUSED_TIMEOUT_S),
               (Run.Status.RESUMING, settings.ORCHESTRATOR_RUN_RESUMING_TIMEOUT_S),
               (Run.Status.RETRYING, settings.ORCHESTRATOR_RUN_RETRYING_TIMEOUT_S)]
    running = Q(status=Run.Status.RUNNING)
    started_long_ago = running & Q(started_at__lt=before(settings.ORCHESTRATOR_RUN_RUNNING_TIMEOUT_S))
    cutoff = before(settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S)
    # ``run_heartbeat_stale_q``'s "silent": a heartbeat before the cutoff, or none and in status
    # since before it. Its complement among running runs: alive, or neither time known (two
    # ranges of the index, not one OR, so that each seeks).
    sign_of_life = Coalesce("last_heartbeat", "status_changed_at")
    silent = Q(LessThan(sign_of_life, cutoff))
    queued = Q(_work_waiting_in_queue())
    return [
        *(Q(status=status, status_changed_at__lt=before(seconds)) for status, seconds in waiting),
        running & silent & ~queued,
        started_long_ago & Q(GreaterThanOrEqual(sign_of_life, cutoff)),
        started_long_ago & Q(IsNull(sign_of_life, True)),
        started_long_ago & silent & queued,
    ]


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
    with moves_may_wait():  # the queue's rows only: a run transaction's kept moves go with its next write
        return {keys[key] for key in jobs_active_dedupe_keys(list(keys))}


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


TIMELINE_FIELDS = ("id", "run_id", "step_id", "number", "outcome", "cost", "retryable", "error_code", "started_at",
                   "finished_at", "step__name", "step__kind", "step__tool", "step__sequence", "step__status",
                   "step__task_id", "step__task__name", "step__task__sequence", "step__task__status",
                   "step__task__agent_id", "step__task__agent__name", "step__task__agent__attempt_number",
                   "step__task__agent__sequence", "step__task__agent__status")  # (the status machines read status)


def run_step_tries(run: Run, *, after: tuple | None = None, limit: int = 500) -> list[StepAttempt]:
    """The run's step tries (every attempt of every step, across run attempts and re-plans), ordered
    by start then id, with their step, task and agent: one query, at most ``limit`` rows after the
    keyset ``after`` = ``(started_at, id)`` of the last row already read."""
    queryset = (StepAttempt.objects.filter(run_id=run.pk).select_related("step__task__agent")
                .only(*TIMELINE_FIELDS).order_by("started_at", "pk"))
    if after is not None:
        started_at, pk = after
        queryset = queryset.filter(Q(started_at__gt=started_at) | Q(started_at=started_at, pk__gt=pk))
    return list(queryset[:limit])


def run_step_try_count(run: Run) -> int:
    """How many step tries the run has (all attempts)."""
    return StepAttempt.objects.filter(run_id=run.pk).count()
