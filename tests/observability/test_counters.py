"""The queue's and the runs' counters: exact after a known sequence of transitions (with a clock
the test moves, so every histogram bucket is known, bounds included), unchanged by a prune of
the jobs, the same from another process, and written by no transition."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from console.retention import retention_prune
from core.models import MetricDelta
from jobs.executor import job_run_claimed
from jobs.metrics import job_counters_rollup
from jobs.models import Job, JobState
from jobs.registry import RetryPolicy
from jobs.services import job_cancel, job_claim, job_enqueue, jobs_enforce_deadlines, jobs_recover_expired
from runs import services as run_services
from runs.models import Run
from tests.conftest import make_plan
from tests.drive import drain_jobs
from tests.observability.test_metrics import TOKEN, scrape, value
from tests.processes import BASE_DIR, database_env

pytestmark = pytest.mark.django_db

COUNTER_PREFIXES = ("orchestrator_job_", "orchestrator_jobs_enqueued", "orchestrator_runs_finished")


@pytest.fixture(autouse=True)
def metrics_token(settings):
    settings.ORCHESTRATOR_METRICS_TOKEN = TOKEN


class Clock:
    """``timezone.now`` of the services, moved by the test."""

    def __init__(self) -> None:
        self.now = datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt_timezone.utc)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float = 0.0, microseconds: int = 0) -> None:
        self.now += timedelta(seconds=seconds, microseconds=microseconds)


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(timezone, "now", clock)
    return clock


def counters(samples) -> dict:
    """The counter and histogram samples of a scrape (not the gauges)."""
    return {name: series for name, series in samples.items() if name.startswith(COUNTER_PREFIXES)
            and not name.endswith("_created")}


def run_next(worker: str = "w") -> Job:
    job = job_claim(worker=worker)
    assert job is not None
    job_run_claimed(job, worker=worker)
    job.refresh_from_db()
    return job


@pytest.fixture(params=["rolled up", "not rolled up"])
def rollup(request, monkeypatch):
    """Each scrape moves finished jobs to the base (the default), or never does: then a prune
    moves them, from the rows it deletes."""
    if request.param == "not rolled up":
        monkeypatch.setattr("jobs.metrics.ROLLUP_MAX_BATCHES", 0)
    return request.param


def test_job_counters_after_a_known_sequence_of_transitions_and_across_a_prune(project, define_job, clock,
                                                                                settings, rollup):
    settings.ORCHESTRATOR_QUEUE_LEASE_S = 15
    define_job(type="obs_flaky", run=lambda ctx, payload: (_ for _ in ()).throw(ConnectionError("down")),
               retry=RetryPolicy(max_attempts=2, base_delay_ms=1, jitter=False), lane=lambda p, pid: "")
    define_job(type="obs_deadline", run=lambda ctx, payload: {"text": "real"}, deadline_ms=500,
               fallback=lambda payload: {"text": "fallback"}, lane=lambda p, pid: "")

    # A noop: waits exactly 0.05 s (the bound of the first bucket), runs 0.250001 s (just past 0.25).
    job_enqueue(job_type="noop", project=project, payload={})
    clock.advance(0.05)
    job_claim(worker="w")
    clock.advance(0.25, microseconds=1)
    job_run_claimed(Job.objects.get(state=JobState.EXECUTING), worker="w")
    # A flaky job: waits 1 s, fails, is retried 1 s later and fails for good (exactly 1 s after its
    # first start: the bound of the 1.0 bucket).
    flaky = job_enqueue(job_type="obs_flaky", project=project, payload={}).job
    clock.advance(1.0)
    assert run_next().state == JobState.AWAITING_TOOL
    clock.advance(1.0)
    assert run_next().state == JobState.FAILED
    # A probe whose worker died: waits 2 s, recovered when its lease expired, then completed 16 s
    # after its first start.
    probe = job_enqueue(job_type="probe", project=project, payload={}).job
    clock.advance(2.0)
    job_claim(worker="dead")
    clock.advance(16.0)
    assert jobs_recover_expired(now=clock.now) == 1
    assert run_next().state == JobState.COMPLETED
    # A noop cancelled while queued; a job completed by its deadline's fallback without starting.
    cancelled = job_enqueue(job_type="noop", project=project, payload={"value": "cancel me"}).job
    job_cancel(job_id=cancelled.pk, reason="not needed")
    job_enqueue(job_type="obs_deadline", project=project, payload={})
    clock.advance(1.0)
    assert jobs_enforce_deadlines(now=clock.now) == 1
    # A noop that waits longer than the last bound (3600 s) and runs in no time.
    job_enqueue(job_type="noop", project=project, payload={})
    clock.advance(4000.0)
    assert run_next().state == JobState.COMPLETED

    background = Job.objects.get(pk=flaky.pk).priority_class
    assert Job.objects.get(pk=probe.pk).priority_class == background
    samples = scrape()
    expected = {
        ("orchestrator_jobs_enqueued_total", (("type", "noop"),)): 3,
        ("orchestrator_job_attempts_total", (("type", "noop"),)): 2,
        ("orchestrator_job_attempts_total", (("type", "obs_flaky"),)): 2,
        ("orchestrator_job_attempts_total", (("type", "probe"),)): 2,
        ("orchestrator_job_attempts_total", (("type", "obs_deadline"),)): 0,
        ("orchestrator_job_retries_total", (("type", "noop"),)): 0,
        ("orchestrator_job_retries_total", (("type", "obs_flaky"),)): 1,
        ("orchestrator_job_retries_total", (("type", "probe"),)): 1,
        ("orchestrator_job_completions_total", (("reason", "completed"), ("type", "noop"))): 2,
        ("orchestrator_job_completions_total", (("reason", "completed"), ("type", "probe"))): 1,
        ("orchestrator_job_completions_total", (("reason", "deadline_fallback"), ("type", "obs_deadline"))): 1,
        ("orchestrator_job_failures_total", (("reason", "max_attempts_exhausted"), ("type", "obs_flaky"))): 1,
        ("orchestrator_job_cancels_total", (("reason", "cancelled"), ("type", "noop"))): 1,
    }
    for (name, labels), count in expected.items():
        assert value(samples, name, **dict(labels)) == count, (name, labels)

    def buckets(name, **labels):
        return {le: value(samples, f"{name}_bucket", **labels, le=le)
                for le in ("0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "30.0", "3600.0", "+Inf")}

    noop_wait = buckets("orchestrator_job_wait_seconds", type="noop", priority=background)
    assert noop_wait == {"0.05": 1, "0.1": 1, "0.25": 1, "0.5": 1, "1.0": 1, "2.5": 1, "5.0": 1, "10.0": 1,
                         "30.0": 1, "3600.0": 1, "+Inf": 2}
    assert value(samples, "orchestrator_job_wait_seconds_sum", type="noop", priority=background) == \
        pytest.approx(4000.05)
    assert buckets("orchestrator_job_wait_seconds", type="obs_flaky", priority=background)["1.0"] == 1
    assert buckets("orchestrator_job_wait_seconds", type="obs_flaky", priority=background)["0.5"] == 0
    probe_wait = buckets("orchestrator_job_wait_seconds", type="probe", priority=background)
    assert (probe_wait["1.0"], probe_wait["2.5"], probe_wait["+Inf"]) == (0, 1, 1)  # the first start only
    noop_run = buckets("orchestrator_job_run_seconds", type="noop", state="completed")
    assert (noop_run["0.05"], noop_run["0.25"], noop_run["0.5"], noop_run["+Inf"]) == (1, 1, 2, 2)
    assert value(samples, "orchestrator_job_run_seconds_sum", type="noop", state="completed") == \
        pytest.approx(0.250001)
    flaky_run = buckets("orchestrator_job_run_seconds", type="obs_flaky", state="failed")
    assert (flaky_run["0.5"], flaky_run["1.0"], flaky_run["+Inf"]) == (0, 1, 1)
    probe_run = buckets("orchestrator_job_run_seconds", type="probe", state="completed")
    assert (probe_run["10.0"], probe_run["30.0"], probe_run["+Inf"]) == (0, 1, 1)
    assert value(samples, "orchestrator_job_run_seconds_count", type="obs_deadline", state="completed") == 0

    # The prune deletes every job: each counter and bucket reads exactly the same afterwards.
    assert Job.objects.filter(counted=True).count() == (6 if rollup == "rolled up" else 0)
    results = retention_prune(only=["jobs"], now=clock.now + timedelta(days=400))
    assert results[0].done == 6
    assert not Job.objects.exists()
    assert counters(scrape()) == counters(samples)


def test_a_transition_writes_no_metric_row(project):
    """Only an enqueue (and a dedupe hit) inserts a sample; claims and outcomes write none."""
    for _ in range(3):
        job_enqueue(job_type="noop", project=project, payload={})
    enqueued = MetricDelta.objects.count()
    drain_jobs()
    assert Job.objects.filter(state=JobState.COMPLETED).count() == 3
    assert MetricDelta.objects.count() == enqueued
    assert set(MetricDelta.objects.values_list("name", flat=True)) == {"jobs_enqueued"}
    assert value(scrape(), "orchestrator_job_completions_total", type="noop", reason="completed") == 3


def test_deleting_one_job_or_a_queryset_twice_counts_each_job_once(project, monkeypatch):
    monkeypatch.setattr("jobs.metrics.ROLLUP_MAX_BATCHES", 0)  # the deletes move the counts
    for _ in range(3):
        job_enqueue(job_type="noop", project=project, payload={})
    drain_jobs()
    before = counters(scrape())
    first = Job.objects.order_by("pk").first()
    first.delete()
    assert Job.objects.filter(pk__in=Job.objects.values("pk")).delete()[0] == 2
    assert Job.objects.all().delete() == (0, {})
    assert counters(scrape()) == before


def test_the_rollup_moves_each_finished_job_to_the_base_once(project):
    for _ in range(3):
        job_enqueue(job_type="noop", project=project, payload={})
    drain_jobs()
    job_enqueue(job_type="noop", project=project, payload={})  # waiting: never rolled up
    stale = Job.objects.order_by("pk").first()
    before = counters(scrape())  # the scrape rolls the finished jobs up first
    assert Job.objects.filter(counted=True).count() == 3
    assert job_counters_rollup() == 0  # nothing left to move
    stale.error = "touched"
    stale.save()  # an instance read before the roll-up does not clear its mark
    assert Job.objects.get(pk=stale.pk).counted
    assert counters(scrape()) == before
    Job.objects.filter(state=JobState.COMPLETED).delete()
    assert counters(scrape()) == before
    assert value(before, "orchestrator_job_completions_total", type="noop", reason="completed") == 3


@pytest.mark.django_db(transaction=True)
def test_runs_finished_by_state_and_reason(org_factory):
    """Every move into completed, failed or cancelled counts once: a cancel before the start, a
    failed run voided, a failure retried that fails again, a completion."""
    organization, project, owner = org_factory(credits=10_000)

    def new_run(name):
        return run_services.run_create(project=project, name=name, plan=make_plan(steps=1), actor=owner).pk

    never_started = new_run("never started")
    run_services.run_cancel(run_id=never_started, actor=owner)
    voided = new_run("voided")
    run_services.run_start(run_id=voided, actor=owner)
    run_services.run_fail(run_id=voided, code="x_err", message="x")
    run_services.run_void(run_id=voided, actor=owner, reason="not wanted")
    retried = new_run("retried")
    run_services.run_start(run_id=retried, actor=owner)
    run_services.run_fail(run_id=retried, code="y_err", message="y")
    run_services.run_retry(run_id=retried, actor=owner)
    run_services.run_fail(run_id=retried, code="z_err", message="z")
    completed = new_run("completed")
    run_services.run_start(run_id=completed, actor=owner)
    drain_jobs(until=lambda: Run.objects.get(pk=completed).status == "completed"
               and not Job.objects.filter(state__in=["queued", "executing", "awaiting_tool"]).exists())
    samples = scrape()
    assert value(samples, "orchestrator_runs_finished_total", state="cancelled", reason="") == 2
    assert value(samples, "orchestrator_runs_finished_total", state="completed", reason="") == 1
    for code in ("x_err", "y_err", "z_err"):
        assert value(samples, "orchestrator_runs_finished_total", state="failed", reason=code) == 1, code
    total = sum(series for series in samples["orchestrator_runs_finished_total"].values())
    assert total == 6


@pytest.mark.django_db(transaction=True)
def test_another_process_scrapes_the_same_counters(project):
    for index in range(4):
        job_enqueue(job_type="noop", project=project, payload={"value": str(index)})
    drain_jobs()
    Job.objects.filter(pk=Job.objects.order_by("pk").values_list("pk", flat=True).first()).delete()
    here = counters(scrape())
    script = ("import sys; from core.metrics import metrics_text; "
              "sys.stdout.write('--- metrics ---\\n' + metrics_text().decode())")
    env = {**database_env(), "ORCHESTRATOR_TRANSITION_LOG_LEVEL": "WARNING"}
    out = subprocess.run([sys.executable, "manage.py", "shell", "-c", script], cwd=BASE_DIR, env=env, check=True,
                         capture_output=True, timeout=120, text=True).stdout.split("--- metrics ---\n", 1)[1]
    there: dict = {}
    for family in text_string_to_metric_families(out):
        for sample in family.samples:
            there.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    assert counters(there) == here
    assert value(here, "orchestrator_job_completions_total", type="noop", reason="completed") == 4
    assert value(here, "orchestrator_job_attempts_total", type="noop") == 4


def test_a_duration_in_sql_is_exact_when_a_second_ends_in_a_fraction_the_database_would_round(db):
    """SQLite reads fractional seconds to the millisecond and rounds: ``...:02.9998`` must stay in
    second 2, or a job's run time is counted one second long."""
    from datetime import datetime, timedelta, timezone as tz

    from django.db import connection

    from core.metrics import micros_between, micros_between_sql

    start = datetime(2026, 1, 1, 0, 0, 1, 996780, tzinfo=tz.utc)
    for end in (start + timedelta(microseconds=3220), datetime(2026, 1, 1, 0, 0, 2, 999800, tzinfo=tz.utc),
                datetime(2026, 1, 1, 0, 0, 3, tzinfo=tz.utc)):
        adapt = connection.ops.adapt_datetimefield_value
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT {micros_between_sql('t.s', 't.e')} FROM (SELECT %s AS s, %s AS e) t",
                           [adapt(start), adapt(end)])
            assert cursor.fetchone()[0] == micros_between(start, end)
