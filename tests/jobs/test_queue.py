"""Scheduling, dedupe, caps, retries, cancellation, deadlines and recovery, in-process."""

import time
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from core.errors import ValidationFailed
from core.models import Event
from jobs.apps import check_q_cluster
from jobs.errors import JobConflict, QueueFull
from jobs.executor import job_run_claimed
from jobs.models import Job, JobReason, JobState
from jobs.registry import Dedupe, FatalJobError, RetryableJobError, RetryPolicy
from jobs.services import (
    job_cancel,
    job_claim,
    job_complete,
    job_enqueue,
    jobs_enforce_deadlines,
    jobs_enforce_interrupt_timeouts,
    jobs_enqueue_many,
    jobs_recover_expired,
)
from jobs.wake import _send as REAL_SEND  # the real sender, kept before any fixture replaces it

LATER = timedelta(hours=1)


def run_next(worker="w1", now=None):
    job = job_claim(worker=worker, now=now)
    if job is not None:
        job_run_claimed(job, worker=worker)
        job.refresh_from_db()
    return job


def enqueue(project, job_type="noop", **payload):
    return job_enqueue(job_type=job_type, project=project, payload=payload).job


def test_priority_then_fifo(project, define_job):
    define_job(type="ordered", run=lambda ctx, p: p["n"], lane=lambda p, pid: "")
    jobs = [job_enqueue(job_type="ordered", project=project, payload={"n": n}, priority=prio).job
            for n, prio in enumerate([5, 1, 5, 1, 3])]
    order = [run_next().result for _ in jobs]
    assert order == [1, 3, 4, 0, 2]


def test_interactive_before_background_at_equal_priority(project, define_job):
    define_job(type="bg", run=lambda ctx, p: "bg", priority_class="background", lane=lambda p, pid: "")
    define_job(type="fg", run=lambda ctx, p: "fg", priority_class="interactive", lane=lambda p, pid: "")
    enqueue(project, "bg")
    enqueue(project, "fg")
    assert [run_next().result, run_next().result] == ["fg", "bg"]


def test_one_executing_job_per_lane(project, define_job):
    define_job(type="laned", run=lambda ctx, p: None, lane=lambda p, pid: p["lane"])
    a1 = job_enqueue(job_type="laned", project=project, payload={"lane": "A"}).job
    job_enqueue(job_type="laned", project=project, payload={"lane": "A"})
    b1 = job_enqueue(job_type="laned", project=project, payload={"lane": "B"}).job
    first = job_claim(worker="w1")
    second = job_claim(worker="w2")
    assert (first.pk, second.pk) == (a1.pk, b1.pk)  # lane A busy: B's job goes next
    assert job_claim(worker="w3") is None  # A busy, B busy (and the global cap is 2)
    assert Job.objects.filter(state=JobState.EXECUTING, lane=f"project:{project.pk}:user:A").count() == 1


def test_global_concurrency_cap(project, settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 2
    for _ in range(3):
        enqueue(project)
    claimed = [job_claim(worker=f"w{i}") for i in range(3)]
    assert claimed[2] is None and all(claimed[:2])
    assert sorted(Job.objects.filter(state=JobState.EXECUTING).values_list("slot", flat=True)) == [0, 1]
    job_complete(job_id=claimed[0].pk, attempt=1, result=None)
    assert job_claim(worker="w4") is not None


def test_aging_lets_a_background_job_through_after_the_burst(project, define_job, settings):
    settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS = 0
    settings.ORCHESTRATOR_QUEUE_MAX_INTERACTIVE_BURST = 3
    define_job(type="bg", run=lambda ctx, p: "bg", priority_class="background")
    define_job(type="fg", run=lambda ctx, p: "fg", priority_class="interactive")
    enqueue(project, "bg")
    for _ in range(5):
        enqueue(project, "fg")
    order = [run_next().result for _ in range(6)]
    assert order == ["fg", "fg", "fg", "bg", "fg", "fg"]


def test_without_aging_interactive_jobs_all_go_first(project, define_job, settings):
    settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS = 3_600_000
    define_job(type="bg", run=lambda ctx, p: "bg", priority_class="background")
    define_job(type="fg", run=lambda ctx, p: "fg", priority_class="interactive")
    enqueue(project, "bg")
    for _ in range(4):
        enqueue(project, "fg")
    assert [run_next().result for _ in range(5)] == ["fg"] * 4 + ["bg"]


def test_each_claim_takes_the_first_job_of_the_claim_order_whatever_the_mix(project, define_job, settings):
    """The claim's SQL against the order's definition (``jobs_claim_order``): priorities, classes,
    lanes busy and idle, delayed jobs, and lanes that ran their interactive burst, changing as
    jobs are claimed and finished."""
    import random

    from jobs.services import jobs_claim_order

    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 100
    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL = 1000
    settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS = 0
    settings.ORCHESTRATOR_QUEUE_MAX_INTERACTIVE_BURST = 2
    for kind in ("background", "interactive"):
        define_job(type=f"mix_{kind}", run=lambda ctx, p: None, priority_class=kind, lane=lambda p, pid: p["lane"])
    rng = random.Random(20261124)
    now = timezone.now()
    for n in range(80):
        job_enqueue(job_type=rng.choice(["mix_background", "mix_interactive"]), project=project,
                    payload={"n": n, "lane": rng.choice(["", "", "A", "B", "C"])}, priority=rng.choice([1, 5, 9]),
                    not_before=rng.choice([None, None, None, now - LATER, now + LATER]))
    claims = 0
    while True:
        aged, ordered = jobs_claim_order(timezone.now())
        expected = aged.first() or ordered.first()
        claimed = job_claim(worker="w1")
        assert (claimed and claimed.pk) == (expected and expected.pk), claims
        if claimed is None:
            break
        claims += 1
        executing = list(Job.objects.filter(state=JobState.EXECUTING).order_by("id"))
        for job in rng.sample(executing, k=min(len(executing), rng.choice([0, 1, 2]))):
            job_complete(job_id=job.pk, attempt=job.attempts, result=None)
    assert claims > 30 and Job.objects.filter(state=JobState.QUEUED, not_before__gt=timezone.now()).exists()


def test_caps_answer_queue_full_with_a_retry_hint(org_factory, settings):
    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = 2
    settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL = 3
    _, first, _ = org_factory()
    _, second, _ = org_factory()
    enqueue(first)
    enqueue(first)
    with pytest.raises(QueueFull) as per_project:
        enqueue(first)
    assert per_project.value.extra["scope"] == "project" and per_project.value.extra["retry_after"] >= 1
    enqueue(second)
    with pytest.raises(QueueFull) as global_cap:
        enqueue(second)
    assert global_cap.value.extra["scope"] == "global"
    assert global_cap.value.status == 429
    assert Job.objects.count() == 3


def test_single_flight_returns_the_active_job(project, define_job):
    define_job(type="suggest", run=lambda ctx, p: "ok", priority_class="interactive",
               dedupe=Dedupe("single_flight", key=lambda p, pid: f"{pid}:{p['session']}"))
    first = job_enqueue(job_type="suggest", project=project, payload={"session": "s1"})
    again = job_enqueue(job_type="suggest", project=project, payload={"session": "s1"})
    other = job_enqueue(job_type="suggest", project=project, payload={"session": "s2"})
    assert first.dedupe == "enqueued" and again.dedupe == "already_queued" and other.dedupe == "enqueued"
    assert again.job.pk == first.job.pk and other.job.pk != first.job.pk
    run_next()
    run_next()
    after = job_enqueue(job_type="suggest", project=project, payload={"session": "s1"})
    assert after.dedupe == "enqueued" and after.job.pk != first.job.pk


def test_drop_and_merge_duplicates(project, define_job):
    define_job(type="explain", run=lambda ctx, p: p,
               dedupe=Dedupe("drop_duplicate", key=lambda p, pid: p["item"]))
    define_job(type="batch", run=lambda ctx, p: sorted(p["items"]),
               dedupe=Dedupe("merge_duplicate", key=lambda p, pid: "batch",
                             merge=lambda old, new: {"items": old["items"] + new["items"]}))
    kept = job_enqueue(job_type="explain", project=project, payload={"item": 1, "text": "a"})
    dropped = job_enqueue(job_type="explain", project=project, payload={"item": 1, "text": "b"})
    assert dropped.dedupe == "dropped" and dropped.job.pk == kept.job.pk
    assert Job.objects.get(pk=kept.job.pk).payload["text"] == "a"
    job_enqueue(job_type="batch", project=project, payload={"items": [2]})
    merged = job_enqueue(job_type="batch", project=project, payload={"items": [1]})
    assert merged.dedupe == "merged"
    assert Job.objects.filter(type="batch").count() == 1
    while run_next() is not None:
        pass
    assert Job.objects.get(type="batch").result == [1, 2]


def test_unknown_type_and_invalid_payload_are_refused_at_enqueue(project):
    with pytest.raises(ValidationFailed) as unknown:
        job_enqueue(job_type="ghost", project=project, payload={})
    assert "type" in unknown.value.errors
    with pytest.raises(ValidationFailed) as invalid:
        job_enqueue(job_type="noop", project=project, payload={"sleep": "forever"})
    assert "payload.sleep" in invalid.value.errors
    with pytest.raises(ValidationFailed):
        job_enqueue(job_type="noop", project=project, payload=["not", "an", "object"])
    assert Job.objects.count() == 0


def test_persisted_unknown_or_invalid_payloads_end_failed(project):
    ghost = Job.objects.create(type="ghost", organization_id=project.organization_id, project=project)
    bad = Job.objects.create(type="noop", organization_id=project.organization_id, project=project,
                             payload={"sleep": "x"})
    for job in (ghost, bad):
        job.to_queued()
        job.save()
    run_next()
    run_next()
    for job in (ghost, bad):
        job.refresh_from_db()
        assert (job.state, job.reason) == (JobState.FAILED, JobReason.INVALID_PAYLOAD)
        assert job.error


def test_retryable_failure_waits_in_awaiting_tool_then_succeeds(project):
    job = enqueue(project, "probe", fail="retryable", times=1)
    run_next()
    job.refresh_from_db()
    assert (job.state, job.reason, job.attempts) == (JobState.AWAITING_TOOL, JobReason.RETRY_SCHEDULED, 1)
    assert job.not_before is not None  # immediate-first linear backoff: the first retry waits 0 ms
    run_next()
    job.refresh_from_db()
    assert (job.state, job.reason, job.attempts, job.failures) == (JobState.COMPLETED, JobReason.COMPLETED, 2, 1)


def test_exponential_backoff_holds_the_job_until_not_before(project, define_job):
    calls = []

    def flaky(ctx, payload):
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            raise RetryableJobError("transient")
        return "ok"

    define_job(type="flaky", run=flaky, retry=RetryPolicy(max_attempts=3, base_delay_ms=10_000, jitter=False))
    job = enqueue(project, "flaky")
    run_next()
    job.refresh_from_db()
    assert job.state == JobState.AWAITING_TOOL
    assert timedelta(seconds=9) < job.not_before - timezone.now() <= timedelta(seconds=10)
    assert job_claim(worker="w1") is None
    run_next(now=timezone.now() + timedelta(seconds=11))
    job.refresh_from_db()
    assert job.state == JobState.COMPLETED and calls == [1, 2]


def test_backoff_strategies():
    exponential = RetryPolicy(base_delay_ms=100, max_delay_ms=30_000, jitter=True)
    for attempt in range(1, 12):
        base = min(100 * 2 ** (attempt - 1), 30_000)
        assert base * 0.9 - 1 <= exponential.delay_ms(attempt) <= base * 1.1 + 1
    linear = RetryPolicy(backoff="immediate_linear", step_ms=60)
    assert [linear.delay_ms(n) for n in (1, 2, 3, 4)] == [0, 60, 120, 180]


@pytest.mark.parametrize("policy, error, reason", [
    (RetryPolicy(max_attempts=2, backoff="immediate_linear"), RetryableJobError, JobReason.MAX_ATTEMPTS),
    (RetryPolicy(max_attempts=5, max_failures=2, backoff="immediate_linear"), RetryableJobError,
     JobReason.MAX_FAILURES),
    (RetryPolicy(max_attempts=5), FatalJobError, JobReason.FATAL),
    (RetryPolicy(max_attempts=5), KeyError, JobReason.FATAL),
])
def test_budgets_end_failed_with_reason_codes(project, define_job, policy, error, reason):
    def always(ctx, payload):
        raise error("boom")

    define_job(type="doomed", run=always, retry=policy)
    job = enqueue(project, "doomed")
    while run_next() is not None:
        pass
    job.refresh_from_db()
    assert (job.state, job.reason) == (JobState.FAILED, reason)
    assert "boom" in job.error


def test_timeout_is_enforced_and_reported(project, define_job):
    import time

    define_job(type="slow", run=lambda ctx, p: time.sleep(5), timeout_s=0.2,
               retry=RetryPolicy(max_attempts=1))
    job = enqueue(project, "slow")
    started = time.monotonic()
    run_next()
    assert time.monotonic() - started < 2
    job.refresh_from_db()
    assert (job.state, job.reason) == (JobState.FAILED, JobReason.TIMEOUT)


def test_a_jobs_time_limit_leaves_the_message_timeout_armed_and_its_handler_called():
    """django-q2 arms an alarm for the whole message: each job's limit is armed over it, and after
    the job the message's alarm is armed again with what is left of it, its handler in place."""
    import signal
    import time

    from jobs.executor import time_limit
    from jobs.registry import JobTimeout

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.4)  # the message's timeout
        with pytest.raises(JobTimeout):
            with time_limit(0.05):
                time.sleep(1)
        for _ in range(3):
            with time_limit(5):
                pass
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 1.0 <= remaining <= 1.4 and fired == []
        time.sleep(remaining + 0.2)
        assert fired == [signal.SIGALRM]  # the message's handler, once
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_cancel_queued_job_at_once(project):
    job = enqueue(project)
    cancelled = job_cancel(job_id=job.pk, reason="not needed")
    assert (cancelled.state, cancelled.reason, cancelled.cancel_reason) == (
        JobState.CANCELLED, JobReason.CANCELLED, "not needed")
    assert job_claim(worker="w1") is None
    assert job_cancel(job_id=job.pk).state == JobState.CANCELLED  # repeat: no-op
    assert Event.objects.filter(type="orchestrator_job_canceled", payload__jobId=job.pk).count() == 1


def test_cancel_executing_job_cooperatively(project):
    job = enqueue(project, "noop", sleep=5)
    claimed = job_claim(worker="w1")
    job_cancel(job_id=job.pk, reason="operator")
    job.refresh_from_db()
    assert job.state == JobState.EXECUTING and job.cancel_requested_at is not None
    assert job_run_claimed(claimed, worker="w1") == "cancelled"
    job.refresh_from_db()
    assert (job.state, job.reason) == (JobState.CANCELLED, JobReason.CANCELLED)


def test_uncooperative_job_is_cancelled_after_the_graceful_window(project, define_job):
    define_job(type="stubborn", run=lambda ctx, p: "late", graceful_ms=1_000, lane=lambda p, pid: "L")
    job = enqueue(project, "stubborn")
    follower = enqueue(project, "stubborn")
    claimed = job_claim(worker="w1")
    job_cancel(job_id=job.pk)
    assert jobs_enforce_interrupt_timeouts() == 0  # still inside the window
    assert jobs_enforce_interrupt_timeouts(now=timezone.now() + timedelta(seconds=2)) == 1
    job.refresh_from_db()
    assert (job.state, job.reason) == (JobState.CANCELLED, JobReason.INTERRUPT_TIMEOUT)
    assert job_run_claimed(claimed, worker="w1") == "discarded"  # the late result is dropped
    job.refresh_from_db()
    assert job.result is None
    assert job_claim(worker="w2").pk == follower.pk  # the lane is free again


def test_mark_cancelled_strategy_ends_an_executing_job_at_once(project, define_job):
    define_job(type="abrupt", run=lambda ctx, p: "x", cancel_strategy="mark_cancelled")
    job = enqueue(project, "abrupt")
    job_claim(worker="w1")
    assert job_cancel(job_id=job.pk).state == JobState.CANCELLED


def test_terminal_jobs_cannot_be_cancelled(project):
    job = enqueue(project)
    run_next()
    with pytest.raises(JobConflict):
        job_cancel(job_id=job.pk)


def test_deadline_completes_with_the_fallback(project, define_job):
    define_job(type="suggest_request", run=lambda ctx, p: {"text": "real"}, priority_class="interactive",
               deadline_ms=500, fallback=lambda p: {"text": "fallback"}, lane=lambda p, pid: "S")
    waiting = enqueue(project, "suggest_request")
    future = timezone.now() + timedelta(seconds=2)
    assert jobs_enforce_deadlines(now=future) == 1
    waiting.refresh_from_db()
    assert (waiting.state, waiting.reason) == (JobState.COMPLETED, JobReason.FALLBACK)
    assert waiting.result == {"fallback": True, "value": {"text": "fallback"}}
    executing = enqueue(project, "suggest_request")
    claimed = job_claim(worker="w1")
    assert jobs_enforce_deadlines(now=future) == 1
    assert job_run_claimed(claimed, worker="w1") == "discarded"  # the late real result is dropped
    executing.refresh_from_db()
    assert (executing.state, executing.result["fallback"]) == (JobState.COMPLETED, True)


def test_a_job_whose_worker_died_is_recovered_then_exhausted(project):
    job = enqueue(project, "probe")  # max_attempts 5
    Job.objects.filter(pk=job.pk).update(max_attempts=2)
    job_claim(worker="dead-1")
    assert jobs_recover_expired() == 0  # lease still valid
    assert jobs_recover_expired(now=timezone.now() + LATER) == 1
    job.refresh_from_db()
    assert (job.state, job.reason, job.attempts, job.slot) == (JobState.AWAITING_TOOL, JobReason.LEASE_EXPIRED, 1, None)
    job_claim(worker="dead-2")
    assert jobs_recover_expired(now=timezone.now() + LATER) == 1
    job.refresh_from_db()
    assert (job.state, job.reason, job.attempts) == (JobState.FAILED, JobReason.RECOVERY_EXHAUSTED, 2)


def test_late_result_of_a_recovered_attempt_is_discarded(project):
    job = enqueue(project, "probe")
    first = job_claim(worker="w1")
    jobs_recover_expired(now=timezone.now() + LATER)
    second = job_claim(worker="w2")
    assert second.attempts == 2
    assert job_complete(job_id=job.pk, attempt=first.attempts, result="stale") is False
    assert job_complete(job_id=job.pk, attempt=second.attempts, result="fresh") is True
    job.refresh_from_db()
    assert job.result == "fresh"


def test_events_use_the_seed_names_and_fields(project, define_job):
    define_job(type="suggest", run=lambda ctx, p: {"text": "hi"}, priority_class="interactive",
               dedupe=Dedupe("single_flight", key=lambda p, pid: p["session"]))
    job = job_enqueue(job_type="suggest", project=project, payload={"session": "s9"}, source_session_id="s9").job
    run_next()
    events = list(Event.objects.filter(payload__jobId=job.pk).order_by("id"))
    assert [e.type for e in events] == ["orchestrator_job_queued", "orchestrator_job_started",
                                        "orchestrator_job_completed"]
    for event in events:
        for key in ("jobId", "projectId", "jobType", "state", "sourceSessionId", "threadId"):
            assert key in event.payload
        assert event.payload["threadId"] == "s9"
        assert event.project_id == project.pk and event.organization_id == project.organization_id
    assert events[-1].payload["result"] == {"text": "hi"}


def test_wake_message_is_sent_only_after_commit(project, monkeypatch, django_capture_on_commit_callbacks):
    sent = []
    monkeypatch.setattr("jobs.wake._send", lambda count: sent.append(count))
    monkeypatch.setattr("jobs.wake._last_wake", 0.0)
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        enqueue(project)
    assert sent == []
    for callback in callbacks:
        callback()
    assert sent == [1]


def test_wakes_within_the_window_share_one_message_sent_when_the_window_ends(settings, monkeypatch):
    from jobs.wake import wake_workers

    settings.ORCHESTRATOR_QUEUE_WAKE_COALESCE_MS = 50
    sent = []
    monkeypatch.setattr("jobs.wake._send", lambda count: sent.append(count))
    monkeypatch.setattr("jobs.wake._last_wake", 0.0)
    monkeypatch.setattr("jobs.wake._deferred", None)
    assert wake_workers() == 1
    assert wake_workers() == 0 and wake_workers() == 0  # inside the window: one deferred message for both
    assert sent == [1]
    deadline = time.monotonic() + 5
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent == [1, 1]
    settings.ORCHESTRATOR_QUEUE_WAKE_COALESCE_MS = 0  # no window: every wake is a message
    assert wake_workers() == 1 and wake_workers() == 1
    assert sent == [1, 1, 1, 1]


def _heartbeats(now, **clusters):
    """Heartbeat rows: ``cluster=[seconds since each of its workers was seen, ...]``."""
    from jobs.models import WorkerHeartbeat

    WorkerHeartbeat.objects.bulk_create(
        WorkerHeartbeat(worker=f"{cluster}:{index}", cluster=cluster, started_at=now - timedelta(minutes=5),
                        last_seen=now - timedelta(seconds=age))
        for cluster, ages in clusters.items() for index, age in enumerate(ages))


def test_a_burst_wakes_every_live_worker_of_the_deployment_not_only_one_clusters(
        project, settings, monkeypatch, django_capture_on_commit_callbacks):
    """Two clusters on one broker: a burst is worth a message to each of their live workers (a
    worker not seen for a lease is not counted); the count is read again after its time to live."""
    from jobs import wake

    settings.ORCHESTRATOR_QUEUE_CLAIM_BATCH = 1  # a claim batch per job: the live workers bound the count
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "workers": 2}
    settings.ORCHESTRATOR_QUEUE_LEASE_S = 15
    settings.ORCHESTRATOR_QUEUE_WAKE_COALESCE_MS = 0
    sent = []
    monkeypatch.setattr("jobs.wake._send", lambda count: sent.append(count))
    monkeypatch.setattr("jobs.wake.waiting_messages", lambda: 0)
    now = timezone.now()
    _heartbeats(now, a=[1, 2, 3], b=[0, 4], c=[60])  # c's only worker died a minute ago
    with django_capture_on_commit_callbacks(execute=True):
        jobs_enqueue_many(job_type="noop", project=project, payloads=[{"value": n} for n in range(10)])
    assert sent == [5]
    assert wake.worker_count() == 5
    _heartbeats(now, d=[0, 0, 0])
    assert wake.worker_count() == 5  # trusted for its time to live
    monkeypatch.setitem(wake._workers_seen, "at", time.monotonic() - wake.WORKERS_SEEN_TTL_S)
    assert wake.worker_count() == 8
    with django_capture_on_commit_callbacks(execute=True):
        jobs_enqueue_many(job_type="noop", project=project, payloads=[{"value": n} for n in range(3)])
    assert sent == [5, 3]  # never more messages than jobs


def test_an_enqueue_wakes_a_worker_per_claim_batch_its_jobs_fill_up_to_the_live_workers(
        project, settings, monkeypatch, django_capture_on_commit_callbacks):
    """A handful of jobs is one worker's claim: waking every worker for them made the others race
    for nothing under the claim lock."""
    settings.ORCHESTRATOR_QUEUE_CLAIM_BATCH = 4
    settings.ORCHESTRATOR_QUEUE_WAKE_COALESCE_MS = 0
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "workers": 2}
    _heartbeats(timezone.now(), a=[0, 0], b=[0, 0])  # four live workers
    sent = []
    monkeypatch.setattr("jobs.wake._send", lambda count: sent.append(count))
    monkeypatch.setattr("jobs.wake.waiting_messages", lambda: 0)
    for jobs in (1, 4, 5, 9, 40):
        with django_capture_on_commit_callbacks(execute=True):
            jobs_enqueue_many(job_type="noop", project=project, payloads=[{"value": n} for n in range(jobs)])
    assert sent == [1, 1, 2, 3, 4]  # ceil(jobs / 4), at most the four workers


def test_a_cluster_alone_or_not_yet_seen_wakes_its_own_workers(project, settings, monkeypatch):
    from jobs import wake

    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "workers": 3}
    assert wake.worker_count() == 3  # no heartbeat row yet
    _heartbeats(timezone.now(), a=[0, 0])
    monkeypatch.setitem(wake._workers_seen, "at", float("-inf"))
    assert wake.worker_count() == 3
    _heartbeats(timezone.now(), b=[0, 0])
    monkeypatch.setitem(wake._workers_seen, "at", float("-inf"))
    assert wake.worker_count() == 4


def test_a_wake_after_an_enqueue_goes_on_with_the_last_count_when_the_database_cannot_say(
        project, settings, monkeypatch, django_capture_on_commit_callbacks):
    from django.db import DatabaseError

    from jobs import wake
    from jobs.models import WorkerHeartbeat

    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "workers": 2}
    settings.ORCHESTRATOR_QUEUE_WAKE_COALESCE_MS = 0
    settings.ORCHESTRATOR_QUEUE_CLAIM_BATCH = 1
    monkeypatch.setitem(wake._workers_seen, "count", 6)
    sent = []
    monkeypatch.setattr("jobs.wake._send", lambda count: sent.append(count))
    monkeypatch.setattr("jobs.wake.waiting_messages", lambda: 0)

    def broken(*args, **kwargs):
        raise DatabaseError("connection lost")

    monkeypatch.setattr(WorkerHeartbeat.objects, "filter", broken)
    with django_capture_on_commit_callbacks(execute=True):
        results = jobs_enqueue_many(job_type="noop", project=project, payloads=[{"value": n} for n in range(10)])
    assert len(results) == 10 and sent == [6]


def test_the_pump_wakes_every_live_worker_for_waiting_jobs_less_the_messages_waiting(project, settings,
                                                                                      monkeypatch):
    from jobs import worker

    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "workers": 2}
    sent = []
    monkeypatch.setattr("jobs.wake._send", lambda count: sent.append(count))
    waiting = {"count": 1}
    monkeypatch.setattr("jobs.wake.waiting_messages", lambda: waiting["count"])
    _heartbeats(timezone.now(), a=[0, 0], b=[0, 0])
    for n in range(10):
        enqueue(project, value=n)
    assert worker.maintain()["woken"] == 3 and sent[-1] == 3  # four workers, one message already waits
    waiting["count"] = 4
    assert worker.maintain()["woken"] == 0


@pytest.mark.parametrize("savepoint", [True, False])
def test_a_retarget_points_an_executing_attempt_at_new_work_unless_an_active_job_holds_its_key(
        project, define_job, savepoint):
    from django.db import transaction

    from jobs.services import job_retarget

    define_job(type="keyed", run=lambda ctx, p: p["n"], lane=lambda p, pid: "",
               dedupe=Dedupe("drop_duplicate", key=lambda p, pid: str(p["n"])))
    first, other = enqueue(project, "keyed", n=1), enqueue(project, "keyed", n=2)
    claimed = job_claim(worker="w1")
    assert claimed.pk == first.pk

    def retarget(n, attempt=1):
        with transaction.atomic():
            return job_retarget(job_id=first.pk, attempt=attempt, job_type="keyed", project_id=project.pk,
                                payload={"n": n}, savepoint=savepoint)

    assert retarget(2) is False  # the waiting job holds that key: it does that work
    first.refresh_from_db()
    assert first.payload == {"n": 1} and first.active_dedupe_key == "keyed:1"
    assert retarget(3, attempt=2) is False  # not the current attempt
    assert retarget(3) is True
    first.refresh_from_db()
    assert first.payload == {"n": 3} and first.active_dedupe_key == "keyed:3" and first.state == "executing"
    other.refresh_from_db()
    assert other.payload == {"n": 2} and other.state == "queued"
    job_cancel(job_id=first.pk, reason="stop")  # cooperative: it is still executing, and gets no more work
    assert retarget(4) is False
    first.refresh_from_db()
    assert first.payload == {"n": 3} and first.state == "executing" and first.cancel_requested_at is not None


def test_hooks_run_after_commit(project, define_job, django_capture_on_commit_callbacks):
    seen = []
    define_job(type="hooked", run=lambda ctx, p: "r", on_queued=lambda job: seen.append(("queued", job.state)),
               on_started=lambda job: seen.append(("started", job.state)),
               on_completed=lambda job: seen.append(("completed", job.result)))
    with django_capture_on_commit_callbacks(execute=True):
        enqueue(project, "hooked")
    with django_capture_on_commit_callbacks(execute=True):
        run_next()
    assert seen == [("queued", "queued"), ("started", "completed"), ("completed", "r")]


def test_start_up_check_refuses_retry_not_above_timeout():
    with pytest.raises(ImproperlyConfigured):
        check_q_cluster({"timeout": 60, "retry": 60})
    check_q_cluster({"timeout": 60, "retry": 61})


def test_a_worker_killed_by_its_message_timeout_retries_then_fails_with_shutdown_timeout(project, define_job):
    from django_q.exceptions import TimeoutException

    def killed(ctx, payload):
        raise TimeoutException("Task exceeded maximum timeout value (60 seconds)")

    define_job(type="killed", run=killed, retry=RetryPolicy(max_attempts=2, backoff="immediate_linear"))
    job = enqueue(project, "killed")
    run_next()
    job.refresh_from_db()
    assert (job.state, job.reason) == (JobState.AWAITING_TOOL, JobReason.SHUTDOWN_TIMEOUT)
    run_next()
    job.refresh_from_db()
    assert (job.state, job.reason) == (JobState.FAILED, JobReason.SHUTDOWN_TIMEOUT)


def test_every_reason_code_is_reached_by_a_test():
    import pathlib

    sources = "".join(path.read_text() for path in pathlib.Path(__file__).parent.glob("test_*.py"))
    unreached = [reason.name for reason in JobReason if reason.value and f"JobReason.{reason.name}" not in sources]
    assert unreached == []


def test_wake_messages_go_through_one_broker_client_per_process_rebuilt_after_a_failure_or_a_fork(monkeypatch):
    """django-q2's ``get_broker`` opens a new client (a new Redis connection) per call: the wake
    messages of a process share one, built again after a failed send and in a forked child."""
    from jobs import wake

    monkeypatch.setattr("jobs.wake._send", REAL_SEND)  # this module's fixture replaces it
    clients = []

    class Broker:
        list_key = "test"

        def __init__(self):
            self.sent, self.fail = [], False
            clients.append(self)

        def enqueue(self, task):
            if self.fail:
                raise ConnectionError("broker down")
            self.sent.append(task)
            return "id"

    monkeypatch.setattr("django_q.brokers.get_broker", lambda list_key=None: Broker())
    monkeypatch.setitem(wake._broker, "client", None)
    assert wake.wake_workers(3, force=True) == 3 and wake.wake_workers(2, force=True) == 2
    assert len(clients) == 1 and len(clients[0].sent) == 5
    clients[0].fail = True
    assert wake.wake_workers(1, force=True) == 0  # logged; the maintenance pump sends it again
    assert wake.wake_workers(1, force=True) == 1 and len(clients) == 2 and len(clients[1].sent) == 1
    wake._after_fork_in_child()
    assert wake.wake_workers(1, force=True) == 1 and len(clients) == 3


def test_messages_no_cluster_has_taken_count_toward_a_wake(db, monkeypatch, settings):
    """Each message still in the broker starts a drain after the wake, and a drain claims until the
    queue is empty: a wake sends only the messages missing, and none while enough wait."""
    from django_q.models import OrmQ

    from jobs import wake

    if "orm" not in settings.Q_CLUSTER:
        pytest.skip("the ORM broker's table is read here (the suite runs without REDIS_URL)")
    settings.ORCHESTRATOR_QUEUE_WAKE_COALESCE_MS = 0
    monkeypatch.setattr("jobs.wake._send", REAL_SEND)
    monkeypatch.setitem(wake._broker, "client", None)
    assert wake.waiting_messages() == 0
    assert wake.wake_workers(2, force=True) == 2 and wake.waiting_messages() == 2
    assert wake.wake_workers(2, force=True) == 0 and wake.wake_workers(1) == 0
    assert wake.wake_workers(3, force=True) == 1 and OrmQ.objects.count() == 3
    taken = wake._client().dequeue()  # a cluster leases what it takes: those no longer count
    assert taken and wake.waiting_messages() == 3 - len(taken)
    assert wake.wake_workers(3, force=True) == len(taken) and wake.waiting_messages() == 3


def test_a_wake_goes_out_when_the_broker_cannot_say_what_waits(db, monkeypatch):
    from jobs import wake

    sent = []
    monkeypatch.setattr("jobs.wake._send", lambda count: sent.append(count))

    class Broker:
        def queue_size(self):
            raise ConnectionError("broker down")

    monkeypatch.setitem(wake._broker, "client", Broker())
    assert wake.wake_workers(2, force=True) == 2 and sent == [2]


def test_whether_a_claim_may_find_a_job_is_told_by_the_waiting_jobs_that_are_due(project):
    from jobs.selectors import jobs_due_exist

    now = timezone.now()
    assert jobs_due_exist(now) is False  # nothing waits
    later = job_enqueue(job_type="noop", project=project, payload={"value": 1}, not_before=now + LATER).job
    assert jobs_due_exist(now) is False  # it waits, but not yet
    assert jobs_due_exist(later.not_before) is True  # its time has come
    enqueue(project, value=2)
    assert jobs_due_exist(now) is True
    assert run_next().state == JobState.COMPLETED
    assert jobs_due_exist(now) is False  # the due one ran; the later one still waits


@pytest.fixture
def draining(monkeypatch, settings):
    """A drain's wake messages (each send's count); no heartbeat thread, no message waiting, the
    drain's claims starting at one job."""
    from jobs import tasks

    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 10
    monkeypatch.setattr("jobs.worker.ensure_started", lambda: None)
    monkeypatch.setattr("jobs.wake.waiting_messages", lambda: 0)
    monkeypatch.setitem(tasks._batch, "size", 1)
    sent = []
    monkeypatch.setattr("jobs.wake._send", lambda count: sent.append(count))
    return sent


def test_a_drain_whose_claim_came_back_full_wakes_one_more_worker_while_jobs_are_due(project, draining):
    """An enqueue wakes a worker per claim batch; jobs claimed one at a time (a worker's claims after
    a slow job) would wait for that one worker: its first full claim brings one more in."""
    from jobs import tasks

    jobs = [enqueue(project, value=n) for n in range(3)]
    assert tasks.drain() == 3
    assert draining == [1]  # one more worker, once per drain
    assert set(Job.objects.filter(pk__in=[job.pk for job in jobs]).values_list("state", flat=True)) == \
        {JobState.COMPLETED}


def test_a_drain_claims_only_while_jobs_are_due_unless_its_last_claim_came_back_full(project, draining,
                                                                                    monkeypatch):
    """A claim takes the claim lock every claim waits for: one that would find nothing (the jobs of
    the message taken by another drain, the claim after a drain's last batch) is not made."""
    from jobs import services, tasks

    claims = []
    claim = services.jobs_claim
    monkeypatch.setattr(services, "jobs_claim", lambda **kwargs: claims.append(kwargs["limit"]) or claim(**kwargs))
    assert tasks.drain() == 0 and claims == []  # nothing waits
    job_enqueue(job_type="noop", project=project, payload={"value": 0}, not_before=timezone.now() + LATER)
    assert tasks.drain() == 0 and claims == []  # only a job for later
    tasks._batch["size"] = 8
    for n in range(3):
        enqueue(project, value=n)
    assert tasks.drain() == 3 and claims == [8]  # a short claim took them all: nothing due after it
    tasks._batch["size"] = 2
    for n in range(2):
        enqueue(project, value=n)
    assert tasks.drain() == 2 and claims == [8, 2, 4]  # after a full claim, the next is made (and finds none)
    assert draining == []


def test_a_drain_that_took_the_last_due_job_or_came_back_short_wakes_nobody(project, draining):
    from jobs import tasks

    enqueue(project, value=1)
    job_enqueue(job_type="noop", project=project, payload={"value": 2}, not_before=timezone.now() + LATER)
    assert tasks.drain() == 1  # a full claim of one, and only a job for later waits
    assert draining == []
    tasks._batch["size"] = 8
    enqueue(project, value=3)
    assert tasks.drain() == 1  # a claim of one where eight were asked for: nothing more to share
    assert draining == []
