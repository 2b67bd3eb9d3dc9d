"""Tenants sharing the queue: lanes a payload names stay inside its project, and per-organization
caps on waiting and executing jobs keep one organization from starving the others."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from core.errors import ValidationFailed
from core.services import project_create
from jobs.errors import QueueFull
from jobs.models import Job, JobState
from jobs.registry import PAYLOAD_LANE_MAX_LENGTH
from jobs.services import job_claim, job_complete, job_enqueue
from tests.jobs.racing import race

COMMAND = {"command": "create_deployment", "args": {"name": "web"}, "idempotency_key": "victim"}


def test_a_payload_lane_naming_another_projects_lane_does_not_block_it(org_factory):
    _, hostile_project, _ = org_factory()
    _, victim_project, _ = org_factory()
    victim_lane = f"project:{victim_project.pk}"
    hostile = job_enqueue(job_type="noop", project=hostile_project, payload={"lane": victim_lane}).job
    assert hostile.lane == f"project:{hostile_project.pk}:user:{victim_lane}"  # inside its own project
    assert job_claim(worker="w1").pk == hostile.pk  # the hostile job executes ...
    victim = job_enqueue(job_type="command", project=victim_project, payload=COMMAND).job
    assert victim.lane == victim_lane
    claimed = job_claim(worker="w2")  # ... and the victim's project lane is still free
    assert claimed is not None and claimed.pk == victim.pk


def test_a_payload_lane_naming_a_run_lane_does_not_block_the_run(org_factory):
    _, hostile_project, _ = org_factory()
    _, victim_project, _ = org_factory()
    hostile = job_enqueue(job_type="probe", project=hostile_project, payload={"lane": "run:41"}).job
    assert job_claim(worker="w1").pk == hostile.pk
    # The run's lane comes from the run the tick is enqueued for, not from its payload.
    tick = job_enqueue(job_type="run_tick", project=victim_project, payload={"run": 41}, run_id=41).job
    assert tick.lane == "run:41"
    claimed = job_claim(worker="w2")
    assert claimed is not None and claimed.pk == tick.pk


def test_payload_lanes_of_one_project_still_serialize(project):
    first = job_enqueue(job_type="noop", project=project, payload={"lane": "deploy"}).job
    second = job_enqueue(job_type="noop", project=project, payload={"lane": "deploy"}).job
    assert first.lane == second.lane == f"project:{project.pk}:user:deploy"
    assert job_claim(worker="w1").pk == first.pk
    assert job_claim(worker="w2") is None  # one job per lane: the second waits for the first


@pytest.mark.parametrize("lane", ["x" * (PAYLOAD_LANE_MAX_LENGTH + 1), "x" * 500, "a\nb", "tab\there", "nul\x00",
                                  "bidi\u202e", 7, ["run:1"], {"lane": "run:1"}])
def test_a_bad_payload_lane_is_a_validation_error_naming_the_field(project, lane):
    with pytest.raises(ValidationFailed) as refused:
        job_enqueue(job_type="noop", project=project, payload={"lane": lane})
    assert "payload.lane" in refused.value.extra["errors"]
    assert Job.objects.count() == 0


def test_the_longest_payload_lane_fits_the_column(project):
    job = job_enqueue(job_type="noop", project=project, payload={"lane": "x" * PAYLOAD_LANE_MAX_LENGTH}).job
    job.refresh_from_db()
    assert len(job.lane) <= Job._meta.get_field("lane").max_length
    assert job.lane.endswith("x" * PAYLOAD_LANE_MAX_LENGTH)


def test_a_definition_cannot_name_an_engine_lane_kind_it_does_not_have():
    from jobs.registry import JobDefinition

    with pytest.raises(ValueError, match="lane"):
        JobDefinition(type="odd", run=lambda ctx, p: None, lane="run:1")


# --- per-organization caps ----------------------------------------------------------------

def test_an_organization_over_its_waiting_cap_gets_queue_full_while_another_enqueues(org_factory, settings):
    settings.ORCHESTRATOR_QUEUE_ORG_MAX_WAITING = 3
    organization, first, _ = org_factory()
    second = project_create(organization=organization, name="second")
    _, elsewhere, _ = org_factory()
    for project in (first, second, second):  # three projects' worth, each under its own cap
        job_enqueue(job_type="noop", project=project, payload={})
    with pytest.raises(QueueFull) as refused:
        job_enqueue(job_type="noop", project=first, payload={})
    assert refused.value.extra["scope"] == "organization" and refused.value.extra["retry_after"] >= 1
    assert job_enqueue(job_type="noop", project=elsewhere, payload={}).dedupe == "enqueued"
    job_complete(job_id=(claimed := job_claim(worker="w1")).pk, attempt=claimed.attempts)  # one finishes
    assert job_enqueue(job_type="noop", project=first, payload={}).dedupe == "enqueued"


def test_the_organization_waiting_cap_defaults_to_half_the_global_cap(org_factory, settings):
    settings.ORCHESTRATOR_QUEUE_ORG_MAX_WAITING = 0
    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = 2
    settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL = 8
    organization, first, _ = org_factory()
    projects = [first] + [project_create(organization=organization, name=f"p{n}") for n in range(2)]
    for project in projects:
        job_enqueue(job_type="noop", project=project, payload={})
    job_enqueue(job_type="noop", project=projects[0], payload={})
    with pytest.raises(QueueFull) as refused:  # 4 waiting = 8 // 2, though project p1 has room
        job_enqueue(job_type="noop", project=projects[1], payload={})
    assert refused.value.extra["scope"] == "organization"


def test_a_flood_from_one_organization_leaves_the_next_slot_to_another(org_factory, settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 3
    settings.ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING = 1
    _, flood_project, _ = org_factory()
    _, quiet_project, _ = org_factory()
    flood = [job_enqueue(job_type="noop", project=flood_project, payload={"n": n}).job for n in range(5)]
    quiet = job_enqueue(job_type="noop", project=quiet_project, payload={}).job  # enqueued last
    assert job_claim(worker="w1").pk == flood[0].pk
    assert job_claim(worker="w2").pk == quiet.pk  # the flood's next jobs are passed over
    assert job_claim(worker="w3") is None  # a slot is free, but the flooding organization is at its cap
    assert Job.objects.filter(pk__in=[job.pk for job in flood[1:]], state=JobState.QUEUED).count() == 4
    job_complete(job_id=flood[0].pk, attempt=1)
    assert job_claim(worker="w4").pk == flood[1].pk  # below its cap again: its next job goes


def test_the_organization_executing_cap_holds_across_its_projects(org_factory, settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 4
    settings.ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING = 2
    organization, first, _ = org_factory()
    second = project_create(organization=organization, name="second")
    for project in (first, second, first, second):
        job_enqueue(job_type="noop", project=project, payload={})
    claimed = [job_claim(worker=f"w{n}") for n in range(3)]
    assert all(claimed[:2]) and claimed[2] is None
    slots = Job.objects.filter(state=JobState.EXECUTING).values_list("organization_slot", flat=True)
    assert sorted(slots) == [0, 1]


def test_the_organization_executing_cap_defaults_to_the_global_concurrency(project, settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 3
    settings.ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING = 0
    for _ in range(4):
        job_enqueue(job_type="noop", project=project, payload={})
    claimed = [job_claim(worker=f"w{n}") for n in range(4)]
    assert all(claimed[:3]) and claimed[3] is None


def test_a_runs_jobs_at_the_executing_cap_wait_queued_and_go_when_a_slot_frees(org_factory, settings):
    """A run's internal jobs count toward their organization: at the cap they stay queued (no
    error, no lost tick) and are claimed as soon as the organization's executing job ends."""
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 2
    settings.ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING = 1
    _, project, _ = org_factory()
    busy = job_enqueue(job_type="noop", project=project, payload={}).job
    assert job_claim(worker="w1").pk == busy.pk
    tick = job_enqueue(job_type="run_tick", project=project, payload={"run": 5}, run_id=5).job
    assert job_claim(worker="w2") is None
    tick.refresh_from_db()
    assert tick.state == JobState.QUEUED
    job_complete(job_id=busy.pk, attempt=1)
    assert job_claim(worker="w2").pk == tick.pk


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_claims_never_exceed_the_organization_cap(org_factory, settings):
    """Eight threads, each with its own connection, claim at once again and again: the flooding
    organization never has more than its cap executing, and the other organization's jobs run."""
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 8
    settings.ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING = 2
    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL = 1000
    flood_org, flood_project, _ = org_factory()
    _, quiet_project, _ = org_factory()
    for n in range(40):
        job_enqueue(job_type="noop", project=flood_project, payload={"n": n})
    for n in range(3):
        job_enqueue(job_type="noop", project=quiet_project, payload={"n": n})
    threads, rounds = 8, 6
    most: list[int] = []
    errors: list[BaseException] = []

    for _ in range(rounds):
        claimed: list[Job] = []
        lock = threading.Lock()

        def claim(index: int) -> None:
            job = job_claim(worker=f"w{index}")
            if job is not None:
                with lock:
                    claimed.append(job)

        errors += race(claim, threads, what="a claim")
        most.append(Job.objects.filter(organization=flood_org, state=JobState.EXECUTING).count())
        for job in claimed:  # finish this round's jobs so the next round races again
            assert job_complete(job_id=job.pk, attempt=job.attempts)
    assert errors == []
    assert max(most) <= 2 and 2 in most
    quiet_done = Job.objects.filter(project=quiet_project, state=JobState.COMPLETED).count()
    assert quiet_done == 3  # the other organization got slots while the flood was capped


def test_a_job_held_back_by_its_organizations_cap_says_so(org_factory, settings):
    from jobs.selectors import job_wait_explain

    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 3
    settings.ORCHESTRATOR_QUEUE_ORG_MAX_EXECUTING = 1
    _, project, _ = org_factory()
    job_enqueue(job_type="noop", project=project, payload={})
    waiting = job_enqueue(job_type="noop", project=project, payload={}).job
    job_claim(worker="w1")
    explanation = job_wait_explain(waiting)
    assert "organization_cap" in [blocker["code"] for blocker in explanation["blockers"]]
    assert explanation["position"] is None  # not claimable while its organization is at its cap


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_an_enqueue_in_flight_never_blocks_a_row_that_refers_to_its_project(org_factory):
    """An enqueue serializes its project and organization with a row lock held to its commit; a
    transaction that meanwhile inserts a row referring to that project (its foreign-key check takes
    a KEY SHARE lock when it commits) must not wait for it: with FOR UPDATE it did, and two clusters
    deadlocked (a 500 on run create, a retried run_step)."""
    from django.db import transaction

    from core.models import Project

    organization, project, _ = org_factory()
    enqueued = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []

    def enqueue_and_hold() -> None:
        try:
            with transaction.atomic():
                job_enqueue(job_type="noop", project=project, payload={"n": 1})
                enqueued.set()
                release.wait(timeout=30)
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)
        finally:
            connection.close()

    holder = threading.Thread(target=enqueue_and_hold, daemon=True)
    holder.start()
    try:
        assert enqueued.wait(timeout=30)
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '3s'")
            # a project (refers to the organization) and its event row (refers to both), committed
            # while the enqueue still holds its locks
            project_create(organization=organization, name="beside an enqueue")
        assert Project.objects.filter(organization=organization, name="beside an enqueue").exists()
    finally:
        release.set()
        holder.join(timeout=30)
    assert errors == []


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_enqueues_stop_exactly_at_the_project_and_organization_caps(org_factory, settings):
    """Twelve threads, each with its own connection, enqueue at once into two projects of one
    organization: the project's cap and the organization's cap hold exactly (the rows are written
    before the caps are locked and counted), and a refused enqueue leaves no job, event or metric."""
    from core.models import Event, MetricDelta

    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = 5
    settings.ORCHESTRATOR_QUEUE_ORG_MAX_WAITING = 7
    settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL = 1000
    organization, first, _ = org_factory()
    second = project_create(organization=organization, name="second")
    threads = 12
    outcomes: list[str] = []
    lock = threading.Lock()

    def enqueue(index: int) -> None:
        for n in range(3):
            try:
                job_enqueue(job_type="noop", project=first if index % 2 else second, payload={"n": n})
                outcome = "enqueued"
            except QueueFull as refused:
                outcome = refused.extra["scope"]
            with lock:
                outcomes.append(outcome)

    errors = race(enqueue, threads, what="an enqueue")
    assert errors == []
    assert outcomes.count("enqueued") == 7 and len(outcomes) == 36
    waiting = Job.objects.filter(organization=organization, state=JobState.QUEUED)
    assert waiting.count() == 7
    assert waiting.filter(project=first).count() <= 5 and waiting.filter(project=second).count() <= 5
    assert Event.objects.filter(type="orchestrator_job_queued", organization_id=organization.pk).count() == 7
    assert sum(MetricDelta.objects.filter(name="jobs_enqueued").values_list("count", flat=True)) == 7
