"""Runs made of jobs.

A started run's job (a ``run_step`` job with its run alone, queued with the start) moves it to
running (spawning its agents), queues a ``run_step`` job for every other step that may start now
and executes the first one itself. ``run_step`` executes a step attempt: the tool is invoked
through the execution command layer with the attempt's idempotency key (run, attempt, step, try),
so a replayed step never repeats its side effect; the outcome is recorded by the run services
(charge, retry with backoff, propagation), and in that same transaction the job goes on with the
run's next runnable step (``_Chain``). ``run_tick`` (lane ``run:<id>``, so one per run at a time)
moves a resumed or retried run along the same way, and wakes a run whose steps wait out a backoff.
Both are idempotent: a tick or a step for a run that moved on does nothing.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from django.conf import settings
from django.db.models import Min
from django.utils import timezone

from core.errors import InvalidTransition, NotFound, ValidationFailed
from core.models import Project
from core.tracing import traced
from jobs.errors import CommandConflict
from jobs.registry import Dedupe, JobCancelled, JobDefinition, JobTimeout, RetryPolicy, register, run_lane_key
from jobs.services import job_retarget, jobs_enqueue_many
from jobs.tools import tool_get
from runs import services
from runs.models import NodeStatus, Run, Step, StepAttempt
from runs.outbox import run_atomic, run_event_record, run_events_flush
from runs.pipeline.gates import gate_execute
from runs.selectors import run_step_jobs_queued

logger = logging.getLogger("orchestrator.runs")

STEP_JOB_TIMEOUT_S = 300


def run_lane(run_id: int) -> str:
    return run_lane_key(run_id)


def _positive_int(payload: dict, key: str, errors: dict) -> None:
    value = payload.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        errors[f"payload.{key}"] = ["a positive integer"]


def _validate_tick(payload: dict) -> dict:
    errors: dict = {}
    _positive_int(payload, "run", errors)
    if errors:
        raise ValidationFailed("invalid payload", errors=errors)
    return payload


def _validate_step(payload: dict) -> dict:
    """``{"run", "step", "round"}``: a step's attempt; ``{"run"}`` alone: the run's start (``_start``)."""
    errors: dict = {}
    _positive_int(payload, "run", errors)
    if "step" in payload or "round" in payload:
        _positive_int(payload, "step", errors)
        if not isinstance(payload.get("round"), int) or isinstance(payload.get("round"), bool):
            errors["payload.round"] = ["an integer"]
    if errors:
        raise ValidationFailed("invalid payload", errors=errors)
    return payload


def _step_key(payload: dict, project_id: int) -> str:
    """A ``run_step`` job's dedupe key: its step and round, or its run for a start."""
    return f"{payload['step']}:{payload['round']}" if "step" in payload else f"start:{payload['run']}"


def run_dispatch(run_id: int, *, not_before=None) -> None:
    """Ask a worker to look at the run (a ``run_tick`` job), now or at ``not_before``: its own
    transaction, for a caller that holds no lock of the run (the reaper, a step job once its
    transaction ended)."""
    run = Run.objects.filter(pk=run_id).first()
    if run is not None:
        with run_atomic():
            _tick_enqueue(run, not_before=not_before)


def run_dispatch_locked(run: Run) -> None:
    """The run's worker job, queued in the transaction that moved the run (start, resume, retry),
    under its lock, after the transaction's run events (the move's come first in the stream). A
    started run that is not gated gets a ``run_step`` job that starts it (``_start``): its tick, then
    its first step, with no job in between; any other a ``run_tick``. No savepoint: a queue cap that
    is reached (``QueueFull``) fails the caller's transaction, so the move is all done or not at all."""
    if run.status != Run.Status.PENDING or run.gated:
        _tick_enqueue(run)
    else:  # under the run's lock, which every writer of the start's key (its run's) holds: none holds it
        _run_job_enqueue(run, RUN_STEP.type, dedupe_checked=True)


def _tick_enqueue(run: Run, *, not_before=None) -> None:
    """In the caller's transaction: the run's ``run_tick`` job (lane ``run:<id>``, one at a time), now
    or at ``not_before``."""
    _run_job_enqueue(run, RUN_TICK.type, not_before=not_before, savepoint=False)


def _run_job_enqueue(run: Run, job_type: str, **options) -> None:
    """A job of ``job_type`` with the run alone in its payload, at the run's priority, queued in the
    caller's transaction after its run events (the move's come first in the stream). Its project is
    built from the run, which carries the ids a job needs (the project's and its organization's):
    the project's row is not read for them."""
    run_events_flush()
    project = Project(pk=run.project_id, organization_id=run.organization_id)
    jobs_enqueue_many(job_type=job_type, project=project, payloads=[{"run": run.pk}], run_id=run.pk,
                      priority=run.priority, **options)


def _tick(ctx, payload: dict) -> dict:
    run_id = payload["run"]
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        return {"run": run_id, "missing": True}
    if run.status == Run.Status.RETRYING:
        run = services.run_requeue(run_id=run_id)
    scheduled: list[int] = []
    if run.status in (Run.Status.PENDING, Run.Status.RESUMING, Run.Status.RUNNING):
        # running (again), a heartbeat and the runnable steps' jobs: one transaction under the run's lock
        run = services.run_mark_running(run_id=run_id, then=lambda locked: scheduled.extend(_schedule(locked)))
    if run.status != Run.Status.RUNNING:
        return {"run": run_id, "status": run.status}
    return {"run": run_id, "status": run.status, "steps": scheduled}


def _schedule(run: Run) -> list[int]:
    """In the transaction that holds the run's lock: record a heartbeat, queue a ``run_step`` job for
    every step that may start now (one already queued is left to its job), or a tick for when the
    first backoff ends."""
    run_events_flush()  # the run's own events before the jobs'
    now = timezone.now()
    services.heartbeat_record(run, now)
    steps = services.runnable_steps(run, now=now)
    _steps_enqueue(run, steps)
    if not steps:
        _wake_after_backoff(run, now)
    return [step.pk for step in steps]


@traced("run step", attributes=lambda ctx, payload: {"run_id": payload["run"], "step_id": payload.get("step"),
                                                     "job_id": ctx.job_id, "project_id": ctx.project_id},
        result_attributes=lambda result: {"attempt": result.get("attempt"), "decision": result.get("decision"),
                                          "error_code": result.get("error"), "step_id": result.get("first_step")})
def _step(ctx, payload: dict) -> dict:
    if "step" not in payload:
        return _start(ctx, payload["run"])
    run_id, step_id = payload["run"], payload["step"]
    recorded: dict = {}
    try:
        with services.run_tree_handed_over(None) as begun:
            attempt = services.step_begin(step_id=step_id, then=lambda run, step, attempt: recorded.update(
                _command_record(run, step, attempt)))
    except (InvalidTransition, NotFound) as exc:
        begun = {"rolled_back": True}
        attempt = _interrupted_attempt(step_id, payload["round"])
        if attempt is None:
            return {"step": step_id, "skipped": getattr(exc, "detail", str(exc))}
        stopped = services.recovery_revalidate(run_id=run_id, attempt=attempt)  # gated runs: pins and last gate first
        if stopped is not None:
            return {"step": step_id, "attempt": attempt.number, "decision": stopped.decision,
                    "stopped": "drift found on recovery"}
    step = recorded.get("step") or Step.objects.select_related("run__project").get(pk=attempt.step_id)
    return _attempts_run(ctx, _Chain(ctx, run_id), step, attempt, recorded, begun)


def _start(ctx, run_id: int) -> dict:
    """A started run's first job: what its tick does (pending → running, its agents spawned, its
    runnable steps scheduled) and, in the same transaction, its first runnable step begun as this
    job's own (the job is pointed at that step, so a recovered job resumes it); then on as any step
    job. A run that moved on meanwhile (cancelled, retried: its retry queued a tick) is left alone."""
    chain = _Chain(ctx, run_id)
    try:
        with services.run_tree_handed_over(None) as begun:
            run = services.run_mark_running(run_id=run_id, then=chain.ticked)
    except (InvalidTransition, NotFound) as exc:
        return {"run": run_id, "skipped": getattr(exc, "detail", str(exc))}
    if chain.next_attempt is None:
        return {"run": run_id, "status": run.status}
    step, attempt, recorded = chain.take()
    return {**_attempts_run(ctx, chain, step, attempt, recorded, begun), "first_step": step.pk}


def _attempts_run(ctx, chain: _Chain, step: Step, attempt: StepAttempt, recorded: dict, begun: dict) -> dict:
    """Execute ``attempt`` (of ``step``, begun by the transaction ``begun`` describes), then the run's
    next steps the chain begins, one after the other; the last one's result."""
    run_id = step.run_id
    left = begun  # what the transaction that began this attempt saw
    while True:
        # The run's tree as the transaction that began this attempt left it (committed) goes on to
        # the one that settles it, which reads it again only if a node changed meanwhile.
        with services.run_tree_handed_over(None if left["rolled_back"] else step.run) as left:
            outcome = _execute_attempt(ctx, step, attempt, then=None if step.run.gated else chain.settled,
                                       recorded=recorded.get("command"))
        result = {"step": step.pk, "attempt": attempt.number, "decision": outcome.decision,
                  "error": outcome.error_code or None}
        if not chain.scheduled:  # a gate, a gated run or an interrupted attempt: the run's tick looks at it
            if step.run.gated:
                services.caps_enforce(run_id=run_id)  # a step that overran its phase's soft cap stops the run here
            not_before = None
            if outcome.decision == "retry":
                not_before = timezone.now() + timedelta(milliseconds=outcome.delay_ms)
            run_dispatch(run_id, not_before=not_before)
            return result
        if chain.next_attempt is None:
            return result
        step, attempt, recorded = chain.take()


class _Chain:
    """What a ``run_step`` job does next, decided in the transaction that settled its step, under
    the run's lock: begin the run's next runnable step itself (its job is pointed at that step, so a
    recovered job resumes it), queue ``run_step`` jobs for the other runnable steps, or a ``run_tick``
    when the run waits out a backoff. It goes on while ``ORCHESTRATOR_RUN_STEP_CHAIN_MS`` lasts and
    the next step's tool fits in what is left of the job's timeout."""

    def __init__(self, ctx, run_id: int):
        self.ctx, self.run_id = ctx, run_id
        self.started = time.monotonic()
        self.scheduled = False
        self.next_attempt: StepAttempt | None = None
        self.next_step: Step | None = None
        self.next_recorded: dict = {}

    def take(self) -> tuple[Step, StepAttempt, dict]:
        step, attempt, recorded = self.next_step, self.next_attempt, self.next_recorded
        self.next_step, self.next_attempt, self.next_recorded, self.scheduled = None, None, {}, False
        return step, attempt, recorded

    def _may_go_on(self, step: Step) -> bool:
        elapsed = time.monotonic() - self.started
        if elapsed * 1000 >= settings.ORCHESTRATOR_RUN_STEP_CHAIN_MS:
            return False  # a job whose cancellation was requested is not retargeted (``job_retarget``)
        tool = tool_get(step.tool) if step.kind == Step.Kind.TOOL else None
        timeout = tool.timeout_s if tool is not None and tool.timeout_s else 0
        return elapsed + timeout + 5 < self.ctx.definition.effective_timeout_s

    def ticked(self, run: Run) -> None:
        """In the transaction that moved the run to running (or found it running), under its lock:
        what a tick schedules (``_schedule``), but the run's first runnable step is this job's."""
        run_events_flush()  # the run's own events before the jobs'
        now = timezone.now()
        services.heartbeat_record(run, now)
        self._go_on(run, now)

    def settled(self, run: Run, outcome: services.StepOutcome) -> None:
        self.scheduled = True
        if outcome.decision != "completed":  # a failure may have moved the run through another copy of it
            run.refresh_from_db(fields=["status"])
        if run.status != Run.Status.RUNNING:
            return  # paused, cancelled, settled or retrying: resume and retry dispatch their own tick
        self._go_on(run, timezone.now())

    def _go_on(self, run: Run, now) -> None:
        """Under the run's lock: begin the first runnable step ``_may_go_on`` allows as this job's
        next one, queue jobs for the others, or a tick for when the first backoff ends. ``now``: one
        instant for what may start and what waits: none falls between the two."""
        steps = services.runnable_steps(run, now=now)
        # Every run_step job of a run is enqueued or pointed at its step under the run's lock, so
        # which steps have a job on the way cannot change meanwhile: the retarget skips a step whose
        # key a job holds, and the other steps are looked up together.
        mine = None
        for step in steps if not run.gated else ():  # a gated run's steps each go through their own job
            if (step.kind == Step.Kind.TOOL and self._may_go_on(step)
                    and job_retarget(job_id=self.ctx.job_id, attempt=self.ctx.attempt, job_type=RUN_STEP.type,
                                     project_id=run.project_id, savepoint=False,
                                     payload={"run": run.pk, "step": step.pk, "round": step.attempts})):
                mine = step
                break
        _steps_enqueue(run, [step for step in steps if step is not mine], flush=True)
        if mine is not None:
            self.next_step = mine  # the run tree's own object: its task and agent move with it
            self.next_attempt = services.step_begin_locked(run, mine)
            self.next_recorded = _command_record(run, mine, self.next_attempt)
        if not steps:
            run_events_flush()
            _wake_after_backoff(run, now)


def _steps_enqueue(run: Run, steps: list[Step], *, flush: bool = False) -> None:
    """Under the run's lock: queue a ``run_step`` job for each of ``steps`` that no active job holds
    yet (else its job is on the way), all in one bulk enqueue. Every ``run_step`` job of a run is
    enqueued or pointed at its step under the run's lock, so the keys looked up cannot be taken
    meanwhile (``dedupe_checked``). ``flush``: the transaction's run events first (a settlement's
    before the jobs' own)."""
    queued = run_step_jobs_queued([(step.pk, step.attempts) for step in steps])
    steps = [step for step in steps if (step.pk, step.attempts) not in queued]
    if not steps:
        return
    if flush:
        run_events_flush()
    jobs_enqueue_many(job_type=RUN_STEP.type, project=run.project, run_id=run.pk, priority=run.priority,
                      payloads=[{"run": run.pk, "step": step.pk, "round": step.attempts} for step in steps],
                      dedupe_checked=True)


def _command_record(run: Run, step: Step, attempt: StepAttempt) -> dict:
    """Record the tool call of a step attempt just begun, in the transaction that begins it (one
    commit for both; the record is committed before the tool runs). Gates and dry runs call no
    tool; an unknown tool is failed by ``_execute_attempt``."""
    from jobs.commands.services import command_record

    step.run = run
    if step.kind != Step.Kind.TOOL or run.mode == "dryrun" or tool_get(step.tool) is None:
        return {"step": step}
    try:
        command = command_record(project=run.project, kind="invoke_tool", args={"tool": step.tool, "args": step.args},
                                 idempotency_key=attempt.idempotency_key, new=True, emit=run_event_record)
    except ValidationFailed:
        return {"step": step}  # invalid arguments: ``command_execute`` finds it again and the attempt fails
    return {"step": step, "command": command}


def _wake_after_backoff(run: Run, now) -> None:
    """No step may start at ``now`` (the instant the runnable steps were found at): when none is
    running either, tick the run when its first backoff ends. The same instant as theirs: a backoff
    that ended after it but before this read would otherwise be neither started nor waited for."""
    current = Step.objects.filter(run=run, task__agent__attempt_number=run.attempt_number)
    if current.filter(status=NodeStatus.RUNNING).exists():
        return
    wake_at = current.filter(status=NodeStatus.PENDING, not_before__gt=now).aggregate(
        at=Min("not_before"))["at"]
    if wake_at is not None:
        _tick_enqueue(run, not_before=wake_at)


def _interrupted_attempt(step_id: int, round_: int) -> StepAttempt | None:
    """The attempt this job began before its worker died: still running, still the step's
    current one. Replaying it reuses its idempotency key, so its side effect is not repeated."""
    return (StepAttempt.objects.filter(step_id=step_id, number=round_ + 1, outcome=StepAttempt.Outcome.RUNNING,
                                       step__attempts=round_ + 1, step__status=NodeStatus.RUNNING,
                                       run__status=Run.Status.RUNNING)
            .first())


def _execute_attempt(ctx, step: Step, attempt, *, then=None, recorded=None) -> services.StepOutcome:
    """Invoke the step's tool and settle the attempt; ``then`` (``step_attempt_succeed``) runs in the
    settling transaction, which on success is also the one that records the command's result.
    ``recorded``: the tool call as recorded with the attempt's begin (``_command_record``)."""
    from jobs.commands.services import CommandFailed, command_execute
    from jobs.executor import time_limit

    run = step.run
    if step.kind != Step.Kind.TOOL:
        return gate_execute(step=step, attempt=attempt)
    if run.mode == "dryrun":  # a dry run executes its checks and gates, never a tool's side effect
        return services.step_attempt_succeed(attempt_id=attempt.pk, output={
            "dryrun": True, "tool": step.tool, "args": step.args}, then=then)
    tool = tool_get(step.tool)
    if tool is None:
        return services.step_attempt_fail(attempt_id=attempt.pk, code="unknown_tool",
                                          message=f"tool {step.tool!r} is not registered", retryable=False,
                                          then=then)
    last = {"at": 0.0, "stop": False}

    def should_stop() -> bool:
        now = time.monotonic()
        if not last["stop"] and now - last["at"] >= 0.1:
            last["at"] = now
            status = Run.objects.filter(pk=run.pk).values_list("status", flat=True).first()
            last["stop"] = status != Run.Status.RUNNING or ctx.should_stop()
        return last["stop"]

    settled: dict = {}
    command_events: list[dict] = []

    def on_success(result) -> None:  # in the transaction that records the command's result
        with run_atomic(savepoint=False):  # its command_succeeded event and the settlement's: one INSERT
            for row in command_events:
                run_event_record(**row)
            settled["outcome"] = services.step_attempt_succeed(attempt_id=attempt.pk, output=result.result,
                                                               then=then, savepoint=False)

    try:
        with time_limit(tool.timeout_s):
            result = command_execute(project=run.project, kind="invoke_tool",
                                     args={"tool": step.tool, "args": step.args},
                                     idempotency_key=attempt.idempotency_key, should_stop=should_stop,
                                     attempt=attempt.number, on_success=on_success, recorded=recorded,
                                     emit=lambda **row: command_events.append(row))
    except JobCancelled:
        return services.step_attempt_abandon(attempt_id=attempt.pk)
    except JobTimeout as exc:
        return services.step_attempt_fail(attempt_id=attempt.pk, code="tool_timeout",
                                          message=f"{step.tool}: {exc}", retryable=True, then=then)
    except CommandFailed as exc:
        return services.step_attempt_fail(attempt_id=attempt.pk, code=exc.reason, message=exc.detail,
                                          retryable=exc.retryable, then=then)
    except (CommandConflict, ValidationFailed) as exc:
        return services.step_attempt_fail(attempt_id=attempt.pk, code=exc.code, message=exc.detail,
                                          retryable=False, then=then)
    if "outcome" in settled:
        return settled["outcome"]
    return services.step_attempt_succeed(attempt_id=attempt.pk, output=result.result, then=then)


RUN_TICK = register(JobDefinition(
    type="run_tick", run=_tick, validate=_validate_tick, priority_class="interactive",
    lane="run",  # the run the tick is enqueued for (run_id), not the payload: one tick per run at a time
    retry=RetryPolicy(max_attempts=5, base_delay_ms=200), timeout_s=60,
))

RUN_STEP = register(JobDefinition(
    type="run_step", run=_step, validate=_validate_step, priority_class="interactive",
    lane="none", claim_alone=True,  # a job goes on with its run's next steps (a chain): never behind others
    spread_runs=True,  # two workers take two runs rather than two branches of one, which wait on its lock
    dedupe=Dedupe("drop_duplicate", key=_step_key),
    retry=RetryPolicy(max_attempts=3, base_delay_ms=200), timeout_s=STEP_JOB_TIMEOUT_S,
))
