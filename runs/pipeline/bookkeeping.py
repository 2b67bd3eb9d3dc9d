"""Gated pipelines' bookkeeping (DESIGN §4, seed 002): phases, running clock, pins, keys.

Called by ``runs.services`` inside its transitions, under the run's row lock, for gated runs
only (``Run.gated``): each phase (a task of the plan) gets a ``PhaseRecord`` when it begins and
its result when it ends; the attempt's running clock (``RunAttempt.active_ms`` +
``active_since``) runs while the run is ``running`` and stops when it pauses or ends, so caps
count running time, never time spent waiting for a human; the plan's pins are recorded when
the attempt begins and a step's when it succeeds; phase keys are claimed when a live run starts and
released when it is voided. Nothing here changes a status.
"""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.utils import timezone

from runs.errors import DriftUnacknowledged, PipelineKeyInUse
from runs.events import GATE_FAILED, GATE_PASSED, GATE_REVALIDATED, RUN_DRIFT_DETECTED
from runs.models import (
    DriftRecord,
    GateReceipt,
    NodeStatus,
    PhaseRecord,
    PipelineKey,
    Run,
    RunAttempt,
    Step,
    StepAttempt,
    Task,
)
from runs.outbox import run_event_record
from runs.pipeline.pins import Drift, pins_record
from runs.plan import plan_step_spec, plan_task_spec

# Seed 002 §6: soft caps of the seed's phases (minutes) and the run's hard cap.
SEED_PHASE_SOFT_CAP_MINUTES = {
    "source_pin": 2, "mark": 5, "cutplan": 10, "backup": 5, "grant_probe": 1, "cut_leg_a": 10,
    "structural_verify": 2, "leg_b_record": 5, "write_verify": 5, "lifecycle_enact": 15, "closeout": 5,
}
RUN_HARD_CAP_MINUTES = 60


def drift_open(run: Run):
    from runs.models import DriftRecord

    return DriftRecord.objects.filter(run=run, attempt_number=run.attempt_number, status=DriftRecord.Status.OPEN)


def drift_refuse_unacknowledged(run: Run) -> None:
    """Raise ``DriftUnacknowledged`` while the run has drift no operator acknowledged."""
    drift = drift_open(run).order_by("id").first()
    if drift is not None:
        raise DriftUnacknowledged(
            f"run {run.pk} stopped on drift of {drift.dimension!r} (recorded {drift.recorded!r}, live "
            f"{drift.live!r}); acknowledge it (with a reason) before resuming",
            dimension=drift.dimension, recorded=drift.recorded, live=drift.live)


# --- caps ----------------------------------------------------------------------------------------

def phase_soft_cap_minutes(run: Run, task: Task) -> float | None:
    """The task's ``soft_cap_minutes``, else the plan's caps for the phase, else seed 002 §6's
    default for a phase of that name, else the plan's ``default_phase_soft_cap_minutes``."""
    spec = plan_task_spec(run.plan, task.agent.name, task.name)
    caps = (run.plan or {}).get("caps") or {}
    for value in (spec.get("soft_cap_minutes"), (caps.get("phase_soft_cap_minutes") or {}).get(task.name),
                  SEED_PHASE_SOFT_CAP_MINUTES.get(task.name), caps.get("default_phase_soft_cap_minutes")):
        if value is not None:
            return float(value)
    return None


def run_hard_cap_minutes(run: Run) -> float:
    caps = (run.plan or {}).get("caps") or {}
    return float(caps.get("run_hard_cap_minutes") or RUN_HARD_CAP_MINUTES)


# --- the running clock -----------------------------------------------------------------------

def attempt_active_ms(attempt: RunAttempt | None, now=None) -> int:
    """Running time of an attempt so far (milliseconds), the current running stretch included."""
    if attempt is None:
        return 0
    total = attempt.active_ms
    if attempt.active_since is not None:
        total += max(0, int(((now or timezone.now()) - attempt.active_since).total_seconds() * 1000))
    return total


def pipeline_clock(run: Run, *, before_status: str) -> None:
    """Start the attempt's clock when the run enters ``running``; stop it when it leaves."""
    if before_status == run.status or not run.gated:
        return
    if Run.Status.RUNNING not in (before_status, run.status):
        return
    attempt = RunAttempt.objects.filter(run=run, number=run.attempt_number).first()
    if attempt is None:
        return
    now = timezone.now()
    if before_status == Run.Status.RUNNING and attempt.active_since is not None:
        attempt.active_ms = attempt_active_ms(attempt, now)
        attempt.active_since = None
    if run.status == Run.Status.RUNNING and attempt.active_since is None:
        attempt.active_since = now
    attempt.save(update_fields=["active_ms", "active_since"])


# --- phases ------------------------------------------------------------------------------------

RESULT_OF_TASK = {NodeStatus.COMPLETED: PhaseRecord.Result.PASSED, NodeStatus.FAILED: PhaseRecord.Result.FAILED,
                  NodeStatus.CANCELLED: PhaseRecord.Result.FAILED}


def phase_moved(run: Run, task: Task, *, action: str) -> None:
    """Keep the task's phase record in step with the task: begun (again), or ended."""
    if not run.gated:
        return
    now = timezone.now()
    if action == "begin":
        attempt = RunAttempt.objects.filter(run=run, number=run.attempt_number).first()
        fields = {"run": run, "attempt_number": run.attempt_number, "name": task.name,
                  "result": PhaseRecord.Result.RUNNING, "soft_cap_minutes": phase_soft_cap_minutes(run, task),
                  "started_at": now, "finished_at": None, "active_ms_at_start": attempt_active_ms(attempt, now),
                  "active_ms_at_end": None, "cap_escalated_at": None}
        PhaseRecord.objects.update_or_create(task=task, defaults=fields)
        return
    result = RESULT_OF_TASK.get(task.status)
    if result is None:
        return
    record = PhaseRecord.objects.filter(task=task).first()
    if record is None or record.result != PhaseRecord.Result.RUNNING:
        return
    attempt = RunAttempt.objects.filter(run=run, number=run.attempt_number).first()
    record.result = result
    record.finished_at = now
    record.active_ms_at_end = attempt_active_ms(attempt, now)
    record.save(update_fields=["result", "finished_at", "active_ms_at_end"])


def phase_of_step(step: Step) -> PhaseRecord | None:
    return PhaseRecord.objects.filter(task_id=step.task_id).first()


# --- pins ------------------------------------------------------------------------------------

def pipeline_begin(run: Run) -> None:
    """An attempt of a gated run begins: record the plan's pins for it."""
    if run.gated and (run.plan or {}).get("pins"):
        pins_record(run=run, specs=run.plan["pins"], source="start")


def step_pins_record(run: Run, step: Step) -> None:
    """A tool step succeeded: record the pins it declares (``"pins"`` on the step in the plan)."""
    if not run.gated or step.kind != Step.Kind.TOOL:
        return
    spec = plan_step_spec(run.plan, step.task.agent.name, step.task.name, step.name)
    if spec.get("pins"):
        pins_record(run=run, specs=spec["pins"], source=f"step:{step.task.name}/{step.name}")


# --- phase keys ----------------------------------------------------------------------------------

def phase_keys(run: Run) -> dict[str, str]:
    """Phase → idempotency key: the plan's ``idempotency_key`` of the task, or ``run:<id>:phase:<name>``."""
    keys = {}
    for agent in (run.plan or {}).get("agents") or []:
        for task in agent.get("tasks") or []:
            keys[task["name"]] = task.get("idempotency_key") or f"run:{run.pk}:phase:{task['name']}"
    return keys


def pipeline_keys_claim(run: Run) -> list[PipelineKey]:
    """Hold the run's phase keys (already held by this run: nothing to do). A key another run
    holds refuses the whole claim with ``pipeline_key_in_use``. A dry run applies no change set:
    it claims no key, so it neither blocks nor is blocked by the live run of the same plan."""
    if not run.gated or run.mode == "dryrun":
        return []
    wanted = phase_keys(run)
    held = set(PipelineKey.objects.filter(run=run, released_at__isnull=True).values_list("key", flat=True))
    taken = (PipelineKey.objects.filter(key__in=list(wanted.values()), released_at__isnull=True)
             .exclude(run=run).first())
    if taken is not None:
        raise PipelineKeyInUse(f"idempotency key {taken.key!r} of phase {taken.phase!r} is held by run "
                               f"{taken.run_id}; void that run to release it", key=taken.key, run=taken.run_id)
    now = timezone.now()
    claimed = []
    try:
        with transaction.atomic():
            for phase, key in wanted.items():
                if key not in held:
                    claimed.append(PipelineKey.objects.create(key=key, run=run, phase=phase, claimed_at=now))
    except IntegrityError as exc:  # another run claimed it between our read and our insert
        raise PipelineKeyInUse("an idempotency key of this run was claimed by another run meanwhile") from exc
    return claimed


def pipeline_keys_release(run: Run, *, reason: str) -> list[str]:
    """Release every key the run holds; returns them."""
    keys = list(PipelineKey.objects.filter(run=run, released_at__isnull=True).values_list("key", flat=True))
    PipelineKey.objects.filter(run=run, released_at__isnull=True).update(released_at=timezone.now(),
                                                                          released_reason=reason)
    return keys


def _receipt_output(receipt: dict) -> dict:
    return {"gate": receipt["gate"], "check": receipt["check"], "passed": receipt["passed"],
            "invariants": receipt["invariants"], "details": receipt["details"]}


def _receipt_create(run: Run, step: Step, attempt: StepAttempt | None, receipt: dict,
                    kind: str = GateReceipt.Kind.GATE) -> GateReceipt:
    record = GateReceipt.objects.create(
        run=run, attempt_number=run.attempt_number, phase=phase_of_step(step), step=step, step_attempt=attempt,
        kind=kind, gate=receipt["gate"], check_name=receipt["check"], args=receipt["args"],
        invariants=receipt["invariants"], details=receipt["details"], passed=receipt["passed"], mode=run.mode,
        pins=receipt["pins"], started_at=receipt["started_at"], finished_at=receipt["finished_at"])
    if kind == GateReceipt.Kind.REVALIDATION:
        event_type = GATE_REVALIDATED
    else:
        event_type = GATE_PASSED if record.passed else GATE_FAILED
    run_event_record(type=event_type, organization_id=run.organization_id,
                     project_id=run.project_id, run_id=run.pk,
                     payload={"run": run.pk, "gate": record.gate, "check": record.check_name, "kind": record.kind,
                              "receipt": record.pk, "passed": record.passed, "invariants": record.invariants,
                              "phase": record.phase.name if record.phase else None})
    return record


def _drift_records(run: Run, drifts: list[Drift], *, before: str, kind: str = DriftRecord.Kind.PIN) -> list:
    now = timezone.now()
    records = [DriftRecord.objects.create(run=run, attempt_number=run.attempt_number, kind=kind,
                                          dimension=d.dimension, recorded=d.recorded, live=d.live,
                                          detected_before=before, detected_at=now) for d in drifts]
    run_event_record(type=RUN_DRIFT_DETECTED, organization_id=run.organization_id, project_id=run.project_id,
                     run_id=run.pk, payload={"run": run.pk, "before": before, "drift": [
                         {"dimension": d.dimension, "recorded": d.recorded, "live": d.live} for d in drifts]})
    return records

