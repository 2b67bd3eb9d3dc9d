"""A gated run whose worker is killed between two gates, on a real ``qcluster``: once the queue
recovers the job, the run goes on from the step that was interrupted and no gate runs twice."""

from __future__ import annotations

import os
import signal

import pytest

from core.models import Event
from jobs.models import Job, WorkerHeartbeat
from runs import services
from runs.invariants import invariants_check
from runs.models import GateReceipt, Run, Step, StepAttempt
from tests.processes import Cluster, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.postgres]


def gate(name, check_name, **args):
    return {"name": name, "kind": "check", "check": check_name, "args": args}


PLAN = {
    "pins": {"run_name": {"provider": "run_field", "args": {"field": "name"}}},
    "agents": [{"name": "pipeline", "tasks": [
        {"name": "phase_one", "steps": [gate("IG_one", "expect", value=1, equals=1)]},
        {"name": "phase_two", "steps": [{"name": "between", "tool": "sleep", "args": {"seconds": 4}},
                                        gate("IG_two", "ledger_balanced")]},
        {"name": "phase_three", "steps": [gate("IG_three", "expect", pin="run_name", equals="kill drill")]},
    ]}],
}


def test_a_worker_killed_between_two_gates_resumes_at_the_interrupted_step(project, tmp_path):
    run = services.run_create(project=project, name="kill drill", plan=PLAN)
    services.run_start(run_id=run.pk)
    between = None
    with Cluster(tmp_path / "qcluster.log", ORCHESTRATOR_Q_NAME="gates-kill", ORCHESTRATOR_Q_WORKERS=2):
        attempt = wait_for(lambda: StepAttempt.objects.filter(run=run, step__name="between",
                                                              outcome="running").first(),
                           timeout=60, message="the step between the gates running")
        between = attempt.step_id
        assert list(GateReceipt.objects.filter(run=run).values_list("gate", flat=True)) == ["IG_one"]
        job = Job.objects.get(type="run_step", run_id=run.pk, payload__step=between, state="executing")
        beat = wait_for(lambda: WorkerHeartbeat.objects.filter(current_job_id=job.pk).first(), timeout=10,
                        message="the worker executing it")
        os.kill(int(beat.worker.rsplit(":", 1)[1]), signal.SIGKILL)
        killed_at = Event.objects.order_by("-id").values_list("id", flat=True).first()
        wait_for(lambda: Run.objects.get(pk=run.pk).status in (Run.Status.COMPLETED, Run.Status.FAILED),
                 timeout=120, interval=0.3, message="the run settled")
    run.refresh_from_db()
    log = (tmp_path / "qcluster.log").read_text()[-3000:]
    assert run.status == Run.Status.COMPLETED, (run.last_error_code, run.last_error, log)
    assert Job.objects.get(pk=job.pk).attempts >= 2  # the killed job was recovered and ran again
    receipts = list(GateReceipt.objects.filter(run=run, kind="gate").order_by("id"))
    assert [(r.gate, r.passed) for r in receipts] == [("IG_one", True), ("IG_two", True), ("IG_three", True)]
    # seed 002 §7: before the interrupted step went on, the last passed gate was checked again (a
    # revalidation, not a second run of the gate step)
    rechecked = GateReceipt.objects.get(run=run, kind="revalidation")
    assert (rechecked.gate, rechecked.passed, rechecked.step_attempt_id) == ("IG_one", True, None)
    for name in ("IG_one", "IG_two", "IG_three"):  # each gate ran once: one attempt, one receipt, one event
        assert StepAttempt.objects.filter(run=run, step__name=name).count() == 1, name
        assert Event.objects.filter(run_id=run.pk, type="gate_passed", payload__gate=name).count() == 1, name
    # it went on from the interrupted step: IG_one before the kill, the step and the gates after it later
    assert Event.objects.get(run_id=run.pk, type="gate_passed", payload__gate="IG_one").id <= killed_at
    assert Event.objects.get(run_id=run.pk, type="gate_passed", payload__gate="IG_two").id > killed_at
    assert StepAttempt.objects.filter(step_id=between, outcome="succeeded").count() == 1
    assert Step.objects.get(pk=between).status == "completed"
    assert run.credits_charged + run.credits_refunded == run.credits_reserved
    assert invariants_check() == []
