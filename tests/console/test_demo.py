"""The living demo: each beat keeps one gated run, one stuck run and a few ordinary runs going."""

from __future__ import annotations

import random
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from billing.selectors import account_balance
from core.models import Organization
from jobs.models import ACTIVE_JOB_STATES, Job
from runs import demo
from runs.invariants import invariants_check
from runs.models import Run
from runs.reaper import runs_reap
from runs.selectors import run_stuck_q
from tests.drive import drain_jobs

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def demo_org(db):
    call_command("seed_demo", stdout=StringIO())
    return Organization.objects.get(name=demo.DEMO_ORGANIZATION)


def test_a_beat_starts_a_gated_run_a_stuck_run_and_an_ordinary_one(demo_org):
    beat = demo.demo_tick(organization=demo_org, rng=random.Random(1))

    assert len(beat.did) == 3, beat.did
    gated = Run.objects.get(name=demo.GATED_NAME)
    wedged = Run.objects.get(name=demo.WEDGED_NAME)
    ordinary = Run.objects.filter(organization=demo_org, name__startswith="demo: research")
    assert gated.status == Run.Status.PENDING and ordinary.count() == 1
    # The stuck run reached running, but no worker was ever handed its work.
    assert wedged.status == Run.Status.RUNNING
    assert not Job.objects.filter(run_id=wedged.pk, state__in=list(ACTIVE_JOB_STATES)).exists()

    # A second beat does not add another gated or stuck run while those are open.
    again = demo.demo_tick(organization=demo_org, rng=random.Random(1))
    assert len(again.did) == 1 and "will complete" in again.did[0]
    assert Run.objects.filter(name=demo.GATED_NAME).count() == 1
    assert Run.objects.filter(name=demo.WEDGED_NAME).count() == 1
    assert invariants_check() == []


def test_the_demo_runs_reach_the_states_an_operator_practises_on(demo_org, settings):
    settings.ORCHESTRATOR_RUN_AUTO_RECOVER = False
    demo.demo_tick(organization=demo_org, rng=random.Random(1))
    drain_jobs(until=lambda: Run.objects.get(name=demo.GATED_NAME).status == Run.Status.PAUSED
               and not Job.objects.filter(state__in=list(ACTIVE_JOB_STATES)).exists())

    gated = Run.objects.get(name=demo.GATED_NAME)
    assert gated.status_reason == "awaiting_approval:release"
    assert Run.objects.get(name__startswith="demo: research").status == Run.Status.COMPLETED

    # Once its heartbeat is older than the timeout the lost run is stuck, and with automatic
    # recovery off the reaper leaves it for the recovery runbook.
    later = timezone.now() + timedelta(seconds=settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S + 5)
    wedged = Run.objects.get(name=demo.WEDGED_NAME)
    assert Run.objects.filter(run_stuck_q(now=later), pk=wedged.pk).exists()
    runs_reap(now=later)
    assert Run.objects.get(pk=wedged.pk).status == Run.Status.RUNNING

    settings.ORCHESTRATOR_RUN_AUTO_RECOVER = True
    runs_reap(now=later)
    wedged.refresh_from_db()
    assert wedged.status == Run.Status.FAILED and wedged.last_error_code == "heartbeat_timeout"
    assert invariants_check() == []


def test_failing_demo_runs_fail_with_a_retryable_error(demo_org):
    rng = random.Random()
    rng.random = lambda: 0.05  # the failing kind
    demo.demo_tick(organization=demo_org, rng=rng)
    drain_jobs(until=lambda: Run.objects.filter(name="demo: ingest (fails)", status=Run.Status.FAILED).exists()
               and Run.objects.get(name=demo.GATED_NAME).status == Run.Status.PAUSED
               and not Job.objects.filter(state__in=list(ACTIVE_JOB_STATES)).exists(), timeout=30)
    failed = Run.objects.get(name="demo: ingest (fails)")
    assert failed.last_error_code and failed.attempts.get().outcome
    # its re-plan had a budget of its own: the run fails with its real cause, not the credit limit
    assert (failed.replan_count, failed.last_error_code) == (1, "drill_retryable"), failed.last_error
    assert invariants_check() == []


def test_the_stream_tops_up_credits_when_they_run_low(demo_org, monkeypatch):
    before = account_balance(organization_id=demo_org.pk)["available"]
    monkeypatch.setattr(demo, "TOPUP_BELOW", before + 1)
    beat = demo.demo_tick(organization=demo_org, rng=random.Random(1))

    assert beat.did[0] == f"topped up {demo.TOPUP_AMOUNT} credits"
    balance = account_balance(organization_id=demo_org.pk)
    assert balance["available"] + balance["reserved"] == before + demo.TOPUP_AMOUNT
    assert invariants_check() == []


def test_demo_stream_command(demo_org):
    out = StringIO()
    call_command("demo_stream", "--once", stdout=out)
    assert "will wait at the approval gate 'release'" in out.getvalue()
    assert out.getvalue().rstrip().endswith("demo stream stopped")


def test_demo_stream_needs_the_seed(db):
    with pytest.raises(CommandError, match="seed_demo"):
        call_command("demo_stream", "--once", stdout=StringIO())
    with pytest.raises(CommandError, match="greater than zero"):
        call_command("demo_stream", "--once", "--interval", "0", stdout=StringIO())


def test_seed_demo_dry_run_lists_what_it_would_create_and_creates_nothing(db):
    import json

    from core.models import AuditRecord

    out = StringIO()
    call_command("seed_demo", "--dry-run", stdout=out)
    planned = json.loads(out.getvalue())
    assert planned["dry_run"] is True
    assert any("Demo Org" in line for line in planned["would_create"]) and "3 demo runs" in planned["would_create"]
    assert not Organization.objects.exists() and not Run.objects.exists() and not AuditRecord.objects.exists()

    out = StringIO()
    call_command("seed_demo", "--reason", "sales demo", stdout=out)
    assert json.loads(out.getvalue())["created"] == planned["would_create"]
    assert set(AuditRecord.objects.filter(action="run_create").values_list("reason", flat=True)) == {"sales demo"}
    out = StringIO()
    call_command("seed_demo", "--dry-run", stdout=out)
    assert json.loads(out.getvalue())["would_create"] == []  # idempotent: nothing left to create


# --- the showcases: a re-plan that heals, a paused queue, a bulk retry -------------------------

def test_seed_demo_pauses_the_nightly_queue_and_the_dashboard_says_why(demo_org, client):
    from django.contrib.auth import get_user_model

    from jobs.models import QueuePause

    pause = QueuePause.objects.get(project__organization=demo_org)
    assert (pause.project.name, pause.reason, pause.actor_label) == (demo.PAUSED_PROJECT, demo.PAUSED_REASON,
                                                                     "operator")
    assert pause.project not in demo.demo_projects(demo_org)  # the stream's ordinary runs go elsewhere
    client.force_login(get_user_model().objects.get(username="operator"))
    html = client.get("/admin/dashboard/").content.decode()
    assert "data-paused-queue=" in html and demo.PAUSED_REASON in html


def test_the_showcase_heals_a_replanned_run_and_keeps_a_run_waiting_in_the_paused_queue(demo_org):
    beat = demo.demo_showcase(organization=demo_org)
    assert len(beat.did) == 2, beat.did
    healing = Run.objects.get(name=demo.HEALS_NAME)
    waiting = Run.objects.get(name=demo.WAITING_NAME)
    assert waiting.project.name == demo.PAUSED_PROJECT
    drain_jobs(until=lambda: Run.objects.get(pk=healing.pk).status == Run.Status.COMPLETED, timeout=60)

    healing.refresh_from_db()
    assert (healing.status, healing.replan_count, healing.last_error_code) == (Run.Status.COMPLETED, 1, "")
    assert healing.agents.filter(name="solo/flaky~replan1", status="completed").exists()
    assert healing.agents.filter(name="solo", status="failed").exists()
    # the paused queue kept the waiting run's job queued: nothing claimed it
    waiting.refresh_from_db()
    assert waiting.status == Run.Status.PENDING
    assert set(Job.objects.filter(run_id=waiting.pk).values_list("state", flat=True)) == {"queued"}
    # a second beat adds nothing while both are on show
    assert demo.demo_showcase(organization=demo_org).did == []
    assert invariants_check() == []


def test_the_showcase_bulk_retries_the_failed_runs_as_a_tracked_operation(demo_org):
    from core.bulk import bulk_operation_process
    from core.models import AuditRecord, BulkOperation

    project = demo.demo_projects(demo_org)[0]
    failing = [demo._start(project, demo.FAILING_NAME, demo.PLAN_FAILING, actor=None, max_attempts=2)
               for _ in range(2)]
    ids = [run.pk for run in failing]
    drain_jobs(until=lambda: Run.objects.filter(pk__in=ids, status=Run.Status.FAILED).count() == 2, timeout=60)

    beat = demo.demo_showcase(organization=demo_org)
    operation = BulkOperation.objects.get()
    assert f"bulk operation {operation.pk}: retrying the 2 failed runs" in beat.did[-1]
    assert (operation.runbook, operation.query, operation.total) == ("runs.run.retry", demo.BULK_QUERY, 2)
    operation = bulk_operation_process(operation_id=operation.pk)  # what the worker's task does
    assert (operation.status, operation.done, operation.skipped, operation.refused) == ("finished", 2, 0, 0)
    assert set(Run.objects.filter(pk__in=ids).values_list("attempt_number", flat=True)) == {2}
    reasons = AuditRecord.objects.filter(action="run_retry", target_id__in=[str(pk) for pk in ids])
    assert {record.reason for record in reasons} == {f"{demo.BULK_REASON} (bulk operation {operation.pk})"}
    # no second bulk retry while the last one is recent
    assert not any("bulk operation" in line for line in demo.demo_showcase(organization=demo_org).did)
    assert BulkOperation.objects.count() == 1
