"""The batch claim and the batched completion: one statement claims several jobs within every
cap, lane and order rule; one statement completes several results and discards stale ones; the
claim's plan stays an index scan once PostgreSQL caches it."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from django.utils import timezone
from django.test.utils import CaptureQueriesContext

from core.models import Event
from jobs.events import JOB_COMPLETED, JOB_STARTED
from jobs.executor import jobs_run_claimed
from jobs.models import Job, JobLane, JobState
from jobs.services import job_claim, job_complete, job_enqueue, jobs_claim, jobs_complete, queue_pause
from tests.jobs.racing import race

pytestmark = pytest.mark.django_db


@pytest.fixture
def types(define_job):
    define_job(type="bg", run=lambda ctx, p: {"echo": p.get("n")}, priority_class="background",
               lane=lambda p, pid: p.get("lane", ""))
    define_job(type="fg", run=lambda ctx, p: {"echo": p.get("n")}, priority_class="interactive",
               lane=lambda p, pid: p.get("lane", ""))


def enqueue(project, job_type="bg", *, priority=None, **payload):
    return job_enqueue(job_type=job_type, project=project, payload=payload, priority=priority).job


def test_a_batch_is_claimed_in_claim_order_priority_then_class_then_fifo(project, types, settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 10
    late_urgent = None
    background = [enqueue(project, "bg", n=n) for n in range(3)]
    interactive = enqueue(project, "fg", n=9)
    late_urgent = enqueue(project, "bg", priority=10, n=10)
    claimed = jobs_claim(worker="w1", limit=10)
    assert [job.pk for job in claimed] == [late_urgent.pk, interactive.pk, *[job.pk for job in background]]
    assert [job.slot for job in claimed] == [0, 1, 2, 3, 4]  # the lowest free slots, in claim order
    assert all(job.state == JobState.EXECUTING and job.attempts == 1 and job.worker == "w1" for job in claimed)
    assert Event.objects.filter(type=JOB_STARTED).count() == 5  # an event per claimed job


def test_a_long_job_is_claimed_alone_at_the_head_of_a_batch_and_the_order_is_kept(project, types, define_job,
                                                                                     settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 10
    define_job(type="long", run=lambda ctx, p: {"echo": p.get("n")}, priority_class="background", lane="none",
               claim_alone=True)
    first, second, long_one, after, long_two = (enqueue(project, "bg", n=1), enqueue(project, "bg", n=2),
                                               enqueue(project, "long", n=3), enqueue(project, "bg", n=4),
                                               enqueue(project, "long", n=5))
    assert [job.pk for job in jobs_claim(worker="w1", limit=10)] == [first.pk, second.pk]  # stops before it
    assert [job.pk for job in jobs_claim(worker="w2", limit=10)] == [long_one.pk]  # heads a batch of one
    assert [job.pk for job in jobs_claim(worker="w1", limit=10)] == [after.pk]
    assert [job.pk for job in jobs_claim(worker="w2", limit=10)] == [long_two.pk]
    assert Job.objects.filter(state=JobState.EXECUTING).count() == 5


def test_jobs_that_spread_runs_give_two_workers_two_runs_priority_and_each_runs_order_kept(project, define_job,
                                                                                            settings):
    """A job of a ``spread_runs`` type whose run has a job executing waits behind another run's job
    of its priority and class; it keeps its place against lower priorities and within its run."""
    from jobs.services import jobs_claim_order

    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 10
    define_job(type="branch", run=lambda ctx, p: None, priority_class="interactive", lane="none", spread_runs=True)

    def branch(run_id, n, priority=None):
        return job_enqueue(job_type="branch", project=project, payload={"n": n}, run_id=run_id,
                           priority=priority).job

    first_a, second_a, third_a = branch(1, 1), branch(1, 2), branch(1, 3)
    first_b, later = branch(2, 4), branch(3, 5, priority=200)
    claims = []
    for worker in ("w1", "w2", "w3"):
        expected = jobs_claim_order(timezone.now())[1].first()
        claims.append(job_claim(worker=worker))
        assert claims[-1].pk == expected.pk  # the claim follows the order's definition
    # run 1's second branch waits while its first executes; run 2's job goes first; the job of a
    # lower priority (a larger number) still waits behind run 1's
    assert [job.pk for job in claims] == [first_a.pk, first_b.pk, second_a.pk]
    assert Job.objects.get(pk=later.pk).state == JobState.QUEUED
    for job in claims:
        job_complete(job_id=job.pk, attempt=job.attempts, result=None)
    assert job_claim(worker="w1").pk == third_a.pk  # run 1 idle again: its next job in FIFO order
    assert job_claim(worker="w2").pk == later.pk


def test_a_batch_takes_one_job_per_lane_and_none_of_a_busy_lane(project, types, settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 10
    busy = enqueue(project, lane="busy")
    assert job_claim(worker="w0").pk == busy.pk
    enqueue(project, lane="busy")
    a1, a2 = enqueue(project, lane="a"), enqueue(project, lane="a")
    b1 = enqueue(project, lane="b")
    free = enqueue(project)
    claimed = jobs_claim(worker="w1", limit=10)
    assert [job.pk for job in claimed] == [a1.pk, b1.pk, free.pk]
    assert Job.objects.get(pk=a2.pk).state == JobState.QUEUED


def test_a_batch_never_exceeds_the_global_or_the_organization_cap(org_factory, types, settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 5
    settings.ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING = 2
    _, flood, _ = org_factory()
    _, quiet, _ = org_factory()
    for n in range(6):
        enqueue(flood, n=n)
    quiet_jobs = [enqueue(quiet, n=n) for n in range(6)]
    first = jobs_claim(worker="w1", limit=16)
    assert len(first) == 4  # two of each organization (their cap), though 5 global slots are free
    assert sorted(job.organization_slot for job in first if job.project_id == flood.pk) == [0, 1]
    assert Job.objects.filter(state=JobState.EXECUTING).count() == 4
    job_complete(job_id=first[0].pk, attempt=1)
    second = jobs_claim(worker="w2", limit=16)
    assert len(second) == 1 and second[0].project_id == first[0].project_id  # the freed slot, refilled
    assert Job.objects.filter(state=JobState.EXECUTING).count() == 4
    settings.ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING = 10
    third = jobs_claim(worker="w3", limit=16)
    assert len(third) == 1  # now the global cap binds: 5 executing
    assert Job.objects.filter(state=JobState.EXECUTING).count() == 5
    assert sorted(Job.objects.filter(state=JobState.EXECUTING).values_list("slot", flat=True)) == [0, 1, 2, 3, 4]
    assert quiet_jobs


@pytest.mark.parametrize("executing", [0, 1, 3, 6])
@pytest.mark.parametrize("batch", [1, 2, 4])
def test_a_claim_fills_the_lowest_free_slots_holes_first_up_to_a_full_batch(org_factory, types, settings, executing,
                                                                            batch):
    """Whatever the executing jobs hold (every other slot, here, global and of their organization), a
    claim of ``batch`` jobs takes that many while slots are free, each the lowest free slot in claim
    order: the claim looks at no more slot numbers than the executing jobs and the batch can need,
    and that is always enough."""
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 2 * executing + batch
    settings.ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING = 2 * executing + batch - 1 or 1
    _, project, _ = org_factory()
    for n in range(2 * executing):
        enqueue(project, n=n)
    held = jobs_claim(worker="w0", limit=2 * executing) if executing else []
    jobs_complete(results=[(job.pk, job.attempts, None) for job in held[1::2]])  # every other slot freed
    waiting = [enqueue(project, n=100 + n) for n in range(batch + 1)]
    claimed = jobs_claim(worker="w1", limit=batch)
    organization_room = settings.ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING - executing
    assert [job.pk for job in claimed] == [job.pk for job in waiting[:min(batch, organization_room)]]
    free = sorted(set(range(settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY)) - {job.slot for job in held[::2]})
    free_in_organization = sorted(set(range(settings.ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING))
                                  - {job.organization_slot for job in held[::2]})
    assert [job.slot for job in claimed] == free[:len(claimed)]
    assert [job.organization_slot for job in claimed] == free_in_organization[:len(claimed)]


def test_aged_background_jobs_of_a_saturated_lane_lead_the_batch(project, types, settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 10
    settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS = 0
    settings.ORCHESTRATOR_QUEUE_MAX_INTERACTIVE_BURST = 1
    enqueue(project, "fg", lane="chat")
    done = job_claim(worker="w1")
    assert job_complete(job_id=done.pk, attempt=1)  # the lane ran its burst of one interactive job
    other = enqueue(project, "fg", priority=1, lane="other")
    aged = enqueue(project, "bg", lane="chat")
    enqueue(project, "fg", lane="chat")
    claimed = jobs_claim(worker="w1", limit=10)
    assert [job.pk for job in claimed] == [aged.pk, other.pk]  # aged first, then the claim order


def test_paused_and_delayed_jobs_stay_out_of_a_batch(project, types, settings, operator):
    from datetime import timedelta

    from django.utils import timezone

    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 10
    ready = enqueue(project)
    job_enqueue(job_type="bg", project=project, payload={}, not_before=timezone.now() + timedelta(hours=1))
    define_paused = enqueue(project, "fg")
    queue_pause(job_type="fg", actor=operator, reason="maintenance")
    assert [job.pk for job in jobs_claim(worker="w1", limit=10)] == [ready.pk]
    assert Job.objects.get(pk=define_paused.pk).state == JobState.QUEUED


def test_batched_completion_discards_a_stale_attempt(project, types, settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 10
    jobs = [enqueue(project, n=n) for n in range(3)]
    claimed = jobs_claim(worker="w1", limit=3)
    with CaptureQueriesContext(connection) as queries:
        done = jobs_complete(results=[(claimed[0].pk, 1, {"ok": 0}), (claimed[1].pk, 2, {"stale": True}),
                                      (claimed[2].pk, 1, None)])
    assert done == {claimed[0].pk, claimed[2].pk}
    updates = [q for q in queries.captured_queries if q["sql"].lstrip().upper().startswith("UPDATE")]
    assert len(updates) == 1  # one statement for the three
    rows = {job.pk: job for job in Job.objects.filter(pk__in=[job.pk for job in jobs])}
    assert (rows[claimed[0].pk].state, rows[claimed[0].pk].result, rows[claimed[0].pk].slot) == \
        (JobState.COMPLETED, {"ok": 0}, None)
    assert (rows[claimed[1].pk].state, rows[claimed[1].pk].result) == (JobState.EXECUTING, None)  # untouched
    assert (rows[claimed[2].pk].state, rows[claimed[2].pk].result) == (JobState.COMPLETED, None)
    assert rows[claimed[0].pk].completed_at is not None and rows[claimed[0].pk].reason == "completed"
    events = list(Event.objects.filter(type=JOB_COMPLETED).order_by("id").values_list("payload", flat=True))
    assert [event["jobId"] for event in events] == [claimed[0].pk, claimed[2].pk]
    assert jobs_complete(results=[(claimed[0].pk, 1, {"again": True})]) == set()  # finished: discarded
    assert Job.objects.get(pk=claimed[0].pk).result == {"ok": 0}


def test_a_claimed_batch_runs_in_order_and_completes_together(project, types, settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 10
    jobs = [enqueue(project, n=n) for n in range(4)]
    claimed = jobs_claim(worker="w1", limit=4)
    assert jobs_run_claimed(claimed, worker="w1") == ["completed"] * 4
    assert [Job.objects.get(pk=job.pk).result for job in jobs] == [{"echo": n} for n in range(4)]
    assert not Job.objects.filter(state=JobState.EXECUTING).exists()


def test_a_batch_job_recovered_while_it_waited_its_turn_is_not_run(project, types, settings, monkeypatch):
    """A batch's later jobs get their leases renewed when their turn comes late; one this worker
    lost meanwhile (recovered by another) is not run by it."""
    from jobs import executor
    from jobs.services import job_requeue

    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 10
    ran: list[int] = []
    first, second = enqueue(project, n=1), enqueue(project, n=2)
    claimed = jobs_claim(worker="w1", limit=2)
    settings.ORCHESTRATOR_QUEUE_LEASE_S = 0  # every turn counts as late
    original = executor.job_execute

    def execute(job, *, worker):
        ran.append(job.pk)
        if job.pk == first.pk:
            job_requeue(job_id=second.pk)  # the second's lease was taken over meanwhile
        return original(job, worker=worker)

    monkeypatch.setattr(executor, "job_execute", execute)
    assert jobs_run_claimed(claimed, worker="w1") == ["completed", "discarded"]
    assert ran == [first.pk]
    assert Job.objects.get(pk=second.pk).state == JobState.AWAITING_TOOL


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_racing_batch_claims_never_exceed_a_cap_or_run_two_jobs_of_a_lane(org_factory, types, settings):
    """Six threads, each with its own connection, claim batches at once, round after round: the
    executing jobs never exceed the global cap or an organization's cap, never hold two jobs of a
    lane, no job is claimed twice and no claim fails."""
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 7
    settings.ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING = 4
    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL = 1000
    projects = [org_factory()[1] for _ in range(2)]
    for n in range(60):
        enqueue(projects[n % 2], "fg" if n % 3 else "bg", lane=f"lane-{n % 5}" if n % 4 else "", n=n)
    threads = 6
    seen: list[int] = []
    lock = threading.Lock()
    while Job.objects.filter(state__in=[JobState.QUEUED]).exists():
        claimed: list[Job] = []

        def claim(index: int) -> None:
            batch = jobs_claim(worker=f"w{index}", limit=3)
            with lock:
                claimed.extend(batch)

        errors = race(claim, threads, what="a claim")
        assert errors == []
        executing = list(Job.objects.filter(state=JobState.EXECUTING).values("lane", "organization_id", "slot"))
        assert 0 < len(executing) <= 7
        lanes = [row["lane"] for row in executing if row["lane"]]
        assert len(lanes) == len(set(lanes))
        for organization in {row["organization_id"] for row in executing}:
            assert sum(row["organization_id"] == organization for row in executing) <= 4
        assert len({row["slot"] for row in executing}) == len(executing)
        seen.extend(job.pk for job in claimed)
        assert jobs_complete(results=[(job.pk, job.attempts, None) for job in claimed]) == {j.pk for j in claimed}
    assert len(seen) == len(set(seen)) == 60
    assert not Job.objects.exclude(state=JobState.COMPLETED).exists()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_prepared_claim_keeps_an_index_scan_from_an_empty_table(project, types, settings):
    """The claim's statements are prepared by the driver after a few executions and PostgreSQL then
    may switch to a generic plan. Executed many times on an empty table first, with statistics taken
    while it was empty (as a queue table's always lag behind it), the pick of the fresh candidates,
    once the table holds thousands of waiting jobs, still walks the claim index in order (no sort,
    no read of the whole table), and the claim statement reads no whole table either."""
    from django.db import transaction
    from django.utils import timezone

    from core.sql import hot_cursor
    from jobs.models import JobLane
    from jobs.services.claim_sql import CLAIM_LOCK_KEY, LOCK_SQL, claim_sql, fresh_sql

    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL = 100_000
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 8
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")
        cursor.execute("ANALYZE jobs_joblane")
    for _ in range(12):
        assert jobs_claim(worker="w1", limit=4) == []  # empty table: the pick prepared, maybe generic
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s", ["%array_agg(f.id)%"])
        assert cursor.fetchone()[0] >= 1  # the driver prepared the pick
    Job.objects.bulk_create([Job(type="bg", organization_id=project.organization_id, project=project,
                                 state=JobState.QUEUED, payload={}, lane=f"lane-{n % 500}" if n % 2 else "",
                                 queued_at=timezone.now()) for n in range(5000)])
    JobLane.objects.bulk_create([JobLane(key=f"lane-{n}", interactive_streak=5 if n < 3 else 0) for n in range(500)])
    for _ in range(6):
        claimed = jobs_claim(worker="w1", limit=4)
        assert len(claimed) == 4
        jobs_complete(results=[(job.pk, job.attempts, None) for job in claimed])
    text = fresh_sql(4)
    assert "LIMIT 16 FOR UPDATE" in text  # constants in the text, so a generic plan still matches the partial index
    with hot_cursor() as cursor:
        cursor.execute("SELECT name FROM pg_prepared_statements WHERE statement LIKE %s",
                       ["%array_agg(f.id)%LIMIT 16 FOR UPDATE%"])
        pick = cursor.fetchone()[0]
        cursor.execute("SELECT name FROM pg_prepared_statements WHERE statement LIKE %s", ["%WITH RECURSIVE%"])
        claim = cursor.fetchone()[0]
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(LOCK_SQL, [CLAIM_LOCK_KEY])  # what every claim says to the planner first
        plan, counts = _explain_prepared(pick, text, sort="on")
        assert "Index Scan using job_claim_order_idx" in plan, (counts, plan)
        assert "Sort Key" not in plan and "Seq Scan on jobs_job " not in plan, (counts, plan)
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('enable_sort', 'on', true)")  # as the pick leaves it
        plan, counts = _explain_prepared(claim, claim_sql(4))
        assert "Seq Scan on jobs_job " not in plan, (counts, plan)  # the claim statement reads no whole table


def _explain_prepared(name: str, text: str, **extra) -> tuple[str, tuple]:
    """The plan PostgreSQL uses now for the prepared statement ``name`` of ``text`` (generic or
    custom), via EXPLAIN EXECUTE with the parameters a claim passes, and its plan counts."""
    import re

    from django.utils import timezone

    from jobs.services.claim import claim_params

    params = {**claim_params(worker="w1", limit=4, now=timezone.now()), **extra}
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", text)))  # $1, $2 ... in order of first use
    with connection.cursor() as cursor:
        cursor.execute("SELECT parameter_types::text, generic_plans, custom_plans FROM pg_prepared_statements"
                       " WHERE name = %s", [name])
        types, generic, custom = cursor.fetchone()
        types = [kind.strip('"') for kind in types.strip("{}").split(",")]
        assert len(types) == len(names)
        def literal(value) -> str:
            return "{" + ",".join(map(str, value)) + "}" if isinstance(value, list) else str(value)

        literals = ", ".join("'{}'::{}".format(literal(params[key]).replace("'", "''"), kind)
                             for key, kind in zip(names, types))
        cursor.execute(f'EXPLAIN EXECUTE "{name}"({literals})')
        return "\n".join(row[0] for row in cursor.fetchall()), (generic, custom)


@pytest.mark.django_db(transaction=True)
def test_each_claimed_job_has_its_executing_event_as_the_api_shows_the_job(project, types, settings):
    """The executing events of a batch (written by the claim statement itself on PostgreSQL) are
    in claim order and carry exactly the job's API form, optional fields included."""
    from core.models import Event
    from jobs.events import JOB_STATE_EVENTS
    from jobs.services import job_as_dict

    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 8
    plain = job_enqueue(job_type="noop", project=project, payload={"n": 0}).job
    threaded = job_enqueue(job_type="noop", project=project, payload={"n": 1}, source_session_id="s-1",
                           thread_id="t-1").job
    claimed = jobs_claim(worker="w1", limit=4)
    assert [job.pk for job in claimed] == [plain.pk, threaded.pk]
    events = list(Event.objects.filter(type=JOB_STATE_EVENTS[JobState.EXECUTING]).order_by("id"))
    assert [event.payload for event in events] == [job_as_dict(Job.objects.get(pk=job.pk)) for job in claimed]
    assert events[1].payload["sourceSessionId"] == "s-1" and "runId" not in events[0].payload
    assert all(event.project_id == project.pk and event.organization_id == project.organization_id
               for event in events)


@pytest.mark.django_db(transaction=True)
def test_a_workers_batch_completes_in_one_statement_with_each_jobs_completed_event(project, types, settings,
                                                                                   caplog):
    """Outside a transaction (a worker's batch) the completion is one statement on PostgreSQL, which
    writes the completed events itself: in the order the results were given, each carrying exactly
    the job's API form; a stale attempt is discarded with no event; each job gets its log line."""
    import logging

    from jobs.services import job_as_dict

    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 8
    plain = enqueue(project, n=0)
    threaded = job_enqueue(job_type="bg", project=project, payload={"n": 1}, source_session_id="s-1",
                           thread_id="t-1").job
    stale = enqueue(project, n=2)
    claimed = {job.pk: job for job in jobs_claim(worker="w1", limit=4)}
    assert set(claimed) == {plain.pk, threaded.pk, stale.pk}
    with CaptureQueriesContext(connection) as queries, caplog.at_level(logging.INFO, "orchestrator.transitions"):
        done = jobs_complete(results=[(threaded.pk, 1, {"answer": [1, 2.5, "x"]}), (stale.pk, 2, {"stale": True}),
                                      (plain.pk, 1, None)])
    assert done == {threaded.pk, plain.pk}
    if connection.vendor == "postgresql":
        assert len(queries.captured_queries) == 1  # no BEGIN, no second statement, no COMMIT
    events = list(Event.objects.filter(type=JOB_COMPLETED).order_by("id"))
    assert [event.payload for event in events] == [job_as_dict(Job.objects.get(pk=pk))
                                                   for pk in (threaded.pk, plain.pk)]
    assert events[0].payload["result"] == {"answer": [1, 2.5, "x"]} and events[1].payload["result"] is None
    assert events[0].payload["sourceSessionId"] == "s-1" and "threadId" not in events[1].payload
    assert all(event.project_id == project.pk and event.organization_id == project.organization_id
               for event in events)
    logged = [record.fields["job_id"] for record in caplog.records
              if getattr(record, "fields", {}).get("to") == JobState.COMPLETED]
    assert logged == [threaded.pk, plain.pk]
    assert Job.objects.get(pk=stale.pk).state == JobState.EXECUTING


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_workers_claim_and_completion_are_prepared_by_their_first_round_trip(project, types, settings):
    """A new connection's claim in one round trip prepares its statements at once, and the claim
    statement and the pick run on one generic plan from then on; a batch's completion is prepared
    at once too. (The driver prepares a statement after a few executions: until then the server
    planned each anew, the claim's under the claim lock.) The connection's threshold is kept."""
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 8
    connection.close()
    for n in range(6):
        enqueue(project, n=n)
    assert len(jobs_claim(worker="w1", limit=2)) == 2  # a connection's first claim: in Django's transaction
    threshold = connection.connection.prepare_threshold
    for _ in range(2):
        claimed = jobs_claim(worker="w1", limit=2)  # one round trip each
        jobs_complete(results=[(job.pk, job.attempts, None) for job in claimed])
    assert connection.connection.prepare_threshold == threshold == settings.DATABASES["default"]["OPTIONS"].get(
        "prepare_threshold", 5)
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")
        prepared = cursor.fetchall()
    claim = [plans for statement, *plans in prepared if "WITH RECURSIVE" in statement]
    pick = [plans for statement, *plans in prepared if "array_agg(f.id)" in statement]
    complete = [plans for statement, *plans in prepared if statement.startswith("WITH done AS (UPDATE")]
    assert claim == [[2, 0]] and pick == [[2, 0]], prepared  # one statement each, both times on its generic plan
    assert len(complete) == 1, prepared
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.EXECUTING, JobState.COMPLETED}


def test_a_claim_counts_each_lanes_interactive_streak_and_a_background_job_resets_it(project, types, settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 10
    interactive = enqueue(project, "fg", lane="a", n=1)
    background = enqueue(project, "bg", lane="b", n=2)
    JobLane.objects.filter(key=background.lane).update(interactive_streak=2)
    claimed = jobs_claim(worker="w1", limit=10)
    assert {job.pk for job in claimed} == {interactive.pk, background.pk}
    streaks = dict(JobLane.objects.filter(key__in=[interactive.lane, background.lane])
                   .values_list("key", "interactive_streak"))
    assert streaks == {interactive.lane: 1, background.lane: 0}
    for job in claimed:
        job_complete(job_id=job.pk, attempt=1, result={})
    enqueue(project, "fg", lane="a", n=3)
    assert len(jobs_claim(worker="w1", limit=10)) == 1
    assert JobLane.objects.get(key=interactive.lane).interactive_streak == 2


@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's planner: PostgreSQL's plan is checked above")
def test_the_sqlite_claim_reads_the_job_table_through_its_indexes_only(project, types, settings):
    """SQLite's statistics say nearly every job has one state (most are completed), and it uses a
    partial index only for a condition written as the index's: the claim statement names the claim
    index's states in its order and the partial indexes of executing jobs, so a claim reads no whole
    table or index of jobs however many there are (it read and sorted them all before)."""
    from django.utils import timezone

    from jobs.services.claim import claim_params
    from jobs.services.claim_sql import claim_sql

    Job.objects.bulk_create([Job(type="bg", organization_id=project.organization_id, project=project,
                                 state=JobState.COMPLETED, payload={}, lane=f"lane-{n % 50}")
                             for n in range(2000)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
        for limit in (1, 32):
            cursor.execute("EXPLAIN QUERY PLAN " + claim_sql(limit),
                           claim_params(worker="w1", limit=limit, now=timezone.now()))
            steps = [row[3] for row in cursor.fetchall()]
            # the job table's aliases j, b and e (o is also a derived table's): read through an index
            job_reads = [step for step in steps if step.split(" ")[:2] in (["SCAN", "j"], ["SEARCH", "j"],
                                                                           ["SCAN", "b"], ["SCAN", "e"],
                                                                           ["SEARCH", "e"])]
            assert job_reads and all(" USING INDEX job_" in step for step in job_reads), steps
            assert "SCAN j USING INDEX job_claim_order_idx" in steps, steps  # in claim order: no sort
            assert "SCAN b USING INDEX job_one_executing_per_lane" in steps, steps
            assert "SCAN o USING INDEX job_one_executing_per_organization_slot" in steps, steps
    enqueue(project, "bg", lane="x", n=1)
    assert len(jobs_claim(worker="w1", limit=4)) == 1


@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's planner")
def test_the_sqlite_maintenance_probe_reads_no_whole_job_table(project, types):
    """The maintenance probe's questions of waiting jobs and of deadlines name the states as their
    partial indexes do, so SQLite answers them from those indexes, not by reading every job."""
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from jobs.selectors import maintenance_due

    Job.objects.bulk_create([Job(type="bg", organization_id=project.organization_id, project=project,
                                 state=JobState.COMPLETED, payload={}) for _ in range(2000)])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    with CaptureQueriesContext(connection) as captured:
        assert maintenance_due(timezone.now()) == {"recover": False, "deadlines": False, "interrupts": False,
                                                   "waiting": False}
    (probe,) = [query["sql"] for query in captured.captured_queries]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN QUERY PLAN " + probe)
        steps = [row[3] for row in cursor.fetchall()]
    assert not [step for step in steps if step.startswith("SCAN jobs_job")], steps  # each probe a search
    assert any("job_active_deadline_idx" in step for step in steps), steps


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_claim_of_its_own_transaction_leaves_the_session_as_it_found_it_and_a_failed_one_holds_nothing(
        project, types, monkeypatch, settings):
    """Outside any transaction a claim sends its whole transaction at once (lock, pick, claim
    statement, commit): after it the session holds no lock and has its planner settings back; a
    statement that fails rolls all of it back (the picked rows and the claim lock are let go)."""
    import psycopg

    from jobs.services import claim as claim_module

    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 10
    first, second, third = (enqueue(project, "bg", n=n) for n in range(3))
    assert [job.pk for job in jobs_claim(worker="w1", limit=1)] == [first.pk]  # learns the session's settings
    assert [job.pk for job in jobs_claim(worker="w1", limit=1)] == [second.pk]

    def session() -> tuple:
        with connection.cursor() as cursor:
            cursor.execute("SELECT current_setting('enable_seqscan'), current_setting('enable_sort'),"
                           " (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())")
            return cursor.fetchone()

    assert session() == ("on", "on", 0)
    assert connection.connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert Job.objects.get(pk=second.pk).state == JobState.EXECUTING
    assert Event.objects.filter(type=JOB_STARTED, payload__jobId=second.pk).count() == 1

    real = claim_module.claim_sql
    monkeypatch.setattr(claim_module, "claim_sql", lambda limit: real(limit).replace("RETURNING", "RETURNING 1/0,"))
    from django.db import DataError

    with pytest.raises(DataError, match="division by zero"):
        jobs_claim(worker="w2", limit=1)
    assert connection.connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert session() == ("on", "on", 0)
    assert Job.objects.get(pk=third.pk).state == JobState.QUEUED  # the failed claim took nothing
    with connection.cursor() as cursor:  # and holds no row: another transaction locks it at once
        cursor.execute("SELECT id FROM jobs_job WHERE id = %s FOR UPDATE NOWAIT", [third.pk])
    monkeypatch.setattr(claim_module, "claim_sql", real)
    assert [job.pk for job in jobs_claim(worker="w2", limit=1)] == [third.pk]
