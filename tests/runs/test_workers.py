"""Runs executed by real ``qcluster`` processes: end to end, crashes, and lost heartbeats."""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter

import pytest

from jobs.models import AdapterCall, CommandRecord, Deployment, WorkerHeartbeat
from runs import services
from runs.invariants import invariants_check
from runs.models import Run, StepAttempt
from tests.conftest import make_plan
from tests.processes import Cluster, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

SETTLED = (Run.Status.COMPLETED, Run.Status.FAILED, Run.Status.CANCELLED)


def start(project, plan, **options):
    run = services.run_create(project=project, name="worker run", plan=plan, **options)
    services.run_start(run_id=run.pk)
    return run


def settled(run_ids) -> bool:
    return Run.objects.filter(pk__in=run_ids, status__in=SETTLED).count() == len(run_ids)


def test_a_plan_runs_end_to_end_on_a_real_cluster(project, tmp_path):
    with Cluster(tmp_path / "qcluster.log", ORCHESTRATOR_Q_NAME="e2e"):
        ok = start(project, make_plan(agents=2, tasks=3, steps=2))
        fatal = start(project, make_plan(tool="fail", args={"mode": "fatal"}))
        flaky = start(project, make_plan(tool="fail", args={"mode": "retryable", "times": 2}))
        wait_for(lambda: settled([ok.pk, fatal.pk, flaky.pk]), timeout=90, interval=0.2, message="runs settled")
    for run in (ok, fatal, flaky):
        run.refresh_from_db()
    assert (ok.status, ok.credits_charged, ok.credits_refunded) == (Run.Status.COMPLETED, 12, 24)
    assert (fatal.status, fatal.last_error_code) == (Run.Status.FAILED, "drill_fatal")
    assert (flaky.status, flaky.credits_charged) == (Run.Status.COMPLETED, 3)
    assert invariants_check() == []


@pytest.mark.postgres
def test_runs_survive_ten_kill_9s_of_their_workers(project, tmp_path):
    plan = {"agents": [
        {"name": f"a{a}", "tasks": [
            {"name": "t", "steps": [
                {"name": "warm", "tool": "sleep", "args": {"seconds": 0.3}},
                {"name": "ship", "tool": "deploy", "args": {"name": f"svc-{a}"}},
                {"name": "cool", "tool": "sleep", "args": {"seconds": 0.2}},
            ]}]} for a in range(2)]}
    runs = [start(project, plan, credit_limit=60) for _ in range(6)]
    rng = random.Random(7)
    kills = 0
    with Cluster(tmp_path / "qcluster.log", ORCHESTRATOR_Q_NAME="crash", ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY=4,
                 ORCHESTRATOR_Q_WORKERS=3):
        deadline = time.monotonic() + 120
        while kills < 10 and not settled([r.pk for r in runs]) and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.1, 0.6))
            beat = WorkerHeartbeat.objects.filter(current_job_id__isnull=False).order_by("?").first()
            if beat is None:
                continue
            try:
                os.kill(int(beat.worker.rsplit(":", 1)[1]), signal.SIGKILL)
                kills += 1
            except ProcessLookupError:
                pass
            WorkerHeartbeat.objects.filter(pk=beat.pk).delete()
        try:
            wait_for(lambda: settled([r.pk for r in runs]), timeout=180, interval=0.3, message="runs settled")
        except AssertionError:
            from jobs.models import Job
            from runs.models import Step
            for r in Run.objects.filter(pk__in=[r.pk for r in runs]):
                print("RUN", r.pk, r.status, r.status_reason, r.last_error_code, r.last_heartbeat)
            for j in Job.objects.exclude(state="completed"):
                print("JOB", j.pk, j.type, j.state, j.reason, j.attempts, j.payload, j.lane, j.not_before, j.lease_expires_at, j.error[:200])
            for st in Step.objects.exclude(status="completed"):
                print("STEP", st.pk, st.run_id, st.name, st.status, st.attempts, st.not_before)
            raise
    statuses = Counter(Run.objects.filter(pk__in=[r.pk for r in runs]).values_list("status", flat=True))
    assert statuses == {Run.Status.COMPLETED: len(runs)}, (statuses, (tmp_path / "qcluster.log").read_text()[-2000:])
    for run in Run.objects.filter(pk__in=[r.pk for r in runs]):
        assert run.credits_charged + run.credits_refunded == run.credits_reserved
    shipped = StepAttempt.objects.filter(run__in=runs, step__tool="deploy", outcome="succeeded")
    assert shipped.count() == 2 * len(runs)
    for attempt in shipped:  # the side effect happened once per step attempt, replays included
        assert Deployment.objects.filter(idempotency_key=attempt.idempotency_key).count() == 1
        assert AdapterCall.objects.filter(idempotency_key=attempt.idempotency_key, outcome="created").count() == 1
    assert Deployment.objects.count() == 2 * len(runs)
    assert invariants_check() == []
    assert kills >= 3


def test_a_stopped_worker_fails_its_run_with_heartbeat_timeout(project, tmp_path):
    run = start(project, make_plan(tool="sleep", args={"seconds": 30}))
    with Cluster(tmp_path / "qcluster.log", ORCHESTRATOR_Q_NAME="sigstop", ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S=3,
                 ORCHESTRATOR_QUEUE_LEASE_S=60, ORCHESTRATOR_Q_WORKERS=2):
        beat = wait_for(lambda: WorkerHeartbeat.objects.filter(current_job_id__isnull=False).first(), timeout=30,
                        message="a worker executing the step")
        wait_for(lambda: StepAttempt.objects.filter(run=run, outcome="running").exists(), timeout=30,
                 message="the step running")
        pid = int(beat.worker.rsplit(":", 1)[1])
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: Run.objects.get(pk=run.pk).status == Run.Status.FAILED, timeout=60, interval=0.2,
                     message="heartbeat timeout")
        finally:
            os.kill(pid, signal.SIGCONT)
    run.refresh_from_db()
    assert run.last_error_code == "heartbeat_timeout"
    assert run.credits_charged + run.credits_refunded == run.credits_reserved
    assert invariants_check() == []


@pytest.mark.postgres
def test_a_worker_killed_after_settling_a_step_and_beginning_the_next_leaves_each_step_charged_once(project, tmp_path):
    """The job that settled ``ship`` went on with ``hold`` (same job, pointed at it); SIGKILL then:
    the recovered job resumes ``hold``'s attempt by its key, the run completes, one charge per step."""
    from billing.models import LedgerEntry
    from jobs.models import Job
    from runs.models import Step

    import http.server
    import threading

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            time.sleep(1.5)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    slow = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    port = slow.server_address[1]
    plan = {"agents": [{"name": "a", "tasks": [{"name": "t", "steps": [
        {"name": "ship", "tool": "deploy", "args": {"name": "svc-chain"}},
        {"name": "hold", "tool": "http_request", "args": {"url": f"http://127.0.0.1:{port}/hold", "timeout": 10}},
        {"name": "ship2", "tool": "deploy", "args": {"name": "svc-chain-2"}},
    ]}]}]}
    with Cluster(tmp_path / "qcluster.log", ORCHESTRATOR_Q_NAME="chain", ORCHESTRATOR_Q_WORKERS=2,
                 ORCHESTRATOR_HTTP_ALLOWED_HOSTS=f"127.0.0.1:{port}"):
        run = start(project, plan, credit_limit=60)
        hold = wait_for(lambda: Step.objects.filter(run=run, name="hold").first(), timeout=60, interval=0.02,
                        message="the run's steps")
        first = wait_for(lambda: Job.objects.filter(run_id=run.pk, type="run_step", state="executing",
                                                    payload__step=hold.pk).first(),
                         timeout=60, interval=0.02, message="a run_step job on hold")
        assert Step.objects.get(run=run, name="ship").status == "completed"
        assert Job.objects.filter(run_id=run.pk, type="run_step").count() == 1  # no new job for hold
        hold_key = StepAttempt.objects.get(step=hold, number=1).idempotency_key
        # hold's tool call was recorded in the transaction that began it (and pointed the job at it)
        assert CommandRecord.objects.filter(idempotency_key=hold_key, status="recorded").exists()
        beat = wait_for(lambda: WorkerHeartbeat.objects.filter(current_job_id=first.pk).first(), timeout=10,
                        interval=0.02, message="the worker of that job")
        os.kill(int(beat.worker.rsplit(":", 1)[1]), signal.SIGKILL)
        WorkerHeartbeat.objects.filter(pk=beat.pk).delete()
        wait_for(lambda: settled([run.pk]), timeout=90, interval=0.2, message="run settled")
    run.refresh_from_db()
    first.refresh_from_db()
    assert run.status == Run.Status.COMPLETED, (tmp_path / "qcluster.log").read_text()[-2000:]
    assert first.attempts >= 2  # the killed attempt was recovered and executed again
    assert StepAttempt.objects.filter(run=run).count() == 3  # hold's interrupted attempt resumed, not retried
    assert CommandRecord.objects.get(idempotency_key=hold_key).status == "succeeded"
    charges = LedgerEntry.objects.filter(run_id=run.pk, kind=LedgerEntry.Kind.CHARGE)
    assert charges.count() == 3
    assert sorted(charges.values_list("idempotency_key", flat=True)) == sorted(
        StepAttempt.objects.filter(run=run).values_list("idempotency_key", flat=True))
    for attempt in StepAttempt.objects.filter(run=run, step__tool="deploy"):
        assert Deployment.objects.filter(idempotency_key=attempt.idempotency_key).count() == 1
        assert AdapterCall.objects.filter(idempotency_key=attempt.idempotency_key, outcome="created").count() == 1
    assert run.credits_charged + run.credits_refunded == run.credits_reserved
    assert invariants_check() == []
    slow.shutdown()
