"""Several jobs of one type queued in one transaction (``jobs_enqueue_many``): all or none."""

import re
from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.db import connection
from django.db.models.signals import post_init

from core.errors import ValidationFailed
from core.models import Event, MetricDelta
from jobs.errors import QueueFull
from jobs.models import Job, JobLane, JobState
from jobs.registry import Dedupe
from core.services import project_create
from jobs.services import job_claim, job_enqueue, jobs_enqueue_many


def test_many_jobs_are_queued_in_order_with_their_events_lanes_and_one_metric_row(project):
    results = jobs_enqueue_many(job_type="noop", project=project,
                                payloads=[{"n": 0}, {"n": 1, "lane": "a"}, {"n": 2, "lane": "a"}, {"n": 3}])
    jobs = [result.job for result in results]
    assert [result.dedupe for result in results] == ["enqueued"] * 4
    assert [job.payload["n"] for job in jobs] == [0, 1, 2, 3]
    assert [job.pk for job in jobs] == sorted(job.pk for job in jobs)  # FIFO follows the list
    stored = Job.objects.filter(pk__in=[job.pk for job in jobs]).order_by("pk")
    assert {job.state for job in stored} == {JobState.QUEUED}
    assert stored[1].lane == stored[2].lane == f"project:{project.pk}:user:a"
    assert JobLane.objects.filter(key=stored[1].lane).count() == 1
    events = list(Event.objects.filter(type="orchestrator_job_queued").order_by("id"))
    assert [event.payload["jobId"] for event in events] == [job.pk for job in jobs]
    assert [(row.labels, row.count) for row in MetricDelta.objects.filter(name="jobs_enqueued")] \
        == [('{"type":"noop"}', 4)]
    claimed = [job_claim(worker="w1").pk for _ in range(2)]
    assert claimed == [jobs[0].pk, jobs[1].pk]  # one lane at a time: job 2 waits behind job 1


def test_an_invalid_payload_names_its_index_and_nothing_is_written(project):
    with pytest.raises(ValidationFailed) as refused:
        jobs_enqueue_many(job_type="noop", project=project, payloads=[{"n": 0}, {"sleep": "long"}, {"n": 2}])
    assert set(refused.value.errors["payloads"]) == {"1"}
    assert "payload.sleep" in refused.value.errors["payloads"]["1"]
    assert not Job.objects.exists() and not Event.objects.filter(type="orchestrator_job_queued").exists()


@pytest.mark.parametrize("payloads, problem", [([], "non-empty"), ("x", "non-empty"),
                                               ([{}] * 1001, "at most 1000")])
def test_an_empty_or_oversized_list_is_refused(project, payloads, problem):
    with pytest.raises(ValidationFailed) as refused:
        jobs_enqueue_many(job_type="noop", project=project, payloads=payloads)
    assert problem in refused.value.errors["payloads"][0]
    assert not Job.objects.exists()


def test_jobs_that_do_not_all_fit_under_a_cap_are_none_of_them_queued(project, settings):
    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = 5
    job_enqueue(job_type="noop", project=project, payload={})
    with pytest.raises(QueueFull) as refused:
        jobs_enqueue_many(job_type="noop", project=project, payloads=[{"n": n} for n in range(5)])
    assert refused.value.extra["scope"] == "project"
    assert "1 jobs waiting (cap 5) (5 more asked for)" in str(refused.value.detail)
    assert Job.objects.count() == 1 and not MetricDelta.objects.filter(name="jobs_enqueued", count=5).exists()
    assert len(jobs_enqueue_many(job_type="noop", project=project, payloads=[{"n": n} for n in range(4)])) == 4


def test_a_deduplicated_type_gets_each_payload_its_own_dedupe_outcome(project, define_job):
    define_job(type="once", run=lambda ctx, p: None,
               dedupe=Dedupe("single_flight", key=lambda p, pid: f"{pid}:{p['k']}"))
    results = jobs_enqueue_many(job_type="once", project=project, payloads=[{"k": "a"}, {"k": "b"}, {"k": "a"}])
    assert [result.dedupe for result in results] == ["enqueued", "enqueued", "already_queued"]
    assert results[2].job.pk == results[0].job.pk
    assert Job.objects.count() == 2


def test_keys_checked_by_the_caller_are_written_in_bulk_and_hold_off_later_duplicates(project, define_job):
    define_job(type="keyed", run=lambda ctx, p: None,
               dedupe=Dedupe("drop_duplicate", key=lambda p, pid: f"{pid}:{p['k']}"))
    results = jobs_enqueue_many(job_type="keyed", project=project, payloads=[{"k": "a"}, {"k": "b"}],
                                dedupe_checked=True)
    assert [result.dedupe for result in results] == ["enqueued", "enqueued"]
    stored = list(Job.objects.order_by("pk").values_list("dedupe_key", "active_dedupe_key"))
    assert stored == [(f"{project.pk}:a", f"keyed:{project.pk}:a"), (f"{project.pk}:b", f"keyed:{project.pk}:b")]
    assert [(row.labels, row.count) for row in MetricDelta.objects.filter(name="jobs_enqueued")] \
        == [('{"type":"keyed"}', 2)]
    later = job_enqueue(job_type="keyed", project=project, payload={"k": "a"})
    assert later.dedupe == "dropped" and later.job.pk == results[0].job.pk
    assert Job.objects.count() == 2


def test_the_workers_are_woken_after_commit_only(project, monkeypatch, django_capture_on_commit_callbacks):
    sent = []
    monkeypatch.setattr("jobs.wake._send", lambda count: sent.append(count))
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        jobs_enqueue_many(job_type="noop", project=project, payloads=[{"n": n} for n in range(3)])
    assert sent == []
    for callback in callbacks:
        callback()
    assert sum(sent) >= 1


def test_every_value_of_the_jobs_is_stored_as_given(project, define_job):
    definition = define_job(type="exact", run=lambda ctx, payload: None, timeout_s=0.1 + 0.2, deadline_ms=1500,
                            fallback=lambda payload: {"late": True})
    payloads = [{"text": text, "n": 2 ** 60 + n, "ratio": 0.1 * n, "nested": {"none": None, "list": [True, "x"]}}
                for n, text in enumerate(['it\'s "quoted"', 'back\\slash \\u0041', 'line\nbreak', 'ünïcode ✓ 🚀'])]
    not_before = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=dt_timezone(timedelta(hours=-7, minutes=-30)))
    jobs = [result.job for result in jobs_enqueue_many(job_type="exact", project=project, payloads=payloads,
                                                        not_before=not_before)]
    for job, payload in zip(jobs, payloads):
        stored = Job.objects.get(pk=job.pk)
        assert stored.payload == payload
        assert stored.not_before == not_before and stored.queued_at == job.queued_at
        assert stored.deadline_at == job.queued_at + timedelta(milliseconds=1500)
        assert stored.timeout_s == definition.effective_timeout_s == 0.1 + 0.2
        assert (stored.type, stored.project_id) == ("exact", project.pk)
        assert stored.organization_id == project.organization_id


def test_each_job_returned_is_its_own_instance_as_the_database_holds_it(project, django_assert_num_queries):
    payloads = [{"n": 0}, {"n": 1, "lane": "a"}, {"n": 2, "lane": "b"}, {"n": 3}]
    jobs = [result.job for result in jobs_enqueue_many(job_type="noop", project=project, payloads=payloads)]
    assert len({id(job) for job in jobs}) == len({job.pk for job in jobs}) == 4
    with django_assert_num_queries(0):  # the project as given, on every job
        assert all(job.project is project for job in jobs)
    fields = [field.attname for field in Job._meta.concrete_fields]
    for job, payload in zip(jobs, payloads):
        stored = Job.objects.get(pk=job.pk)
        assert {name: getattr(job, name) for name in fields} == {name: getattr(stored, name) for name in fields}
        assert job.payload == payload and not job._state.adding
    assert [job.lane for job in jobs] == ["", f"project:{project.pk}:user:a", f"project:{project.pk}:user:b", ""]
    jobs[1].payload["n"] = 99
    assert [job.payload["n"] for job in jobs] == [0, 99, 2, 3]


def test_jobs_are_built_one_by_one_while_something_listens_to_their_building(project):
    built = []

    def listener(sender, instance, **kwargs):
        built.append(instance)

    post_init.connect(listener, sender=Job)
    try:
        results = jobs_enqueue_many(job_type="noop", project=project, payloads=[{"n": n} for n in range(3)])
    finally:
        post_init.disconnect(listener, sender=Job)
    assert [id(instance) for instance in built] == [id(result.job) for result in results]
    assert Job.objects.filter(state=JobState.QUEUED).count() == 3


def test_each_cap_refuses_exactly_past_its_limit_with_its_scopes_own_count(org_factory, settings):
    """The caps' counts read the total first and a scope's own count only when the total is past
    what its cap lets through: at every size of enqueue around every cap, the answer (queued, or
    refused by the first scope over its cap, with that scope's own count) is the one the counts of
    each scope taken one by one give, whatever the other projects and organizations hold."""
    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = 4
    settings.ORCHESTRATOR_QUEUE_ORG_MAX_WAITING = 6
    settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL = 9
    organization, project, _ = org_factory()
    sibling = project_create(organization=organization, name="sibling")
    _, elsewhere, _ = org_factory()

    def expected(target, asked):
        waiting = Job.objects.filter(state=JobState.QUEUED)
        for count, cap, scope in ((waiting.filter(project=target).count(), 4, "project"),
                                  (waiting.filter(organization_id=target.organization_id).count(), 6, "organization"),
                                  (waiting.count(), 9, "global")):
            if count + asked > cap:
                return scope, count
        return None

    outcomes = set()
    for target, asked in [(elsewhere, 3), (project, 1), (sibling, 2), (project, 4), (project, 3), (sibling, 3),
                          (project, 2), (elsewhere, 2), (elsewhere, 4), (sibling, 1), (project, 1), (elsewhere, 1)]:
        want = expected(target, asked)
        if want is None:
            assert len(jobs_enqueue_many(job_type="noop", project=target, payloads=[{}] * asked)) == asked
        else:
            with pytest.raises(QueueFull) as refused:
                jobs_enqueue_many(job_type="noop", project=target, payloads=[{}] * asked)
            assert refused.value.extra["scope"] == want[0]
            assert f" {want[1]} jobs waiting (cap " in str(refused.value.detail), (want, refused.value.detail)
        outcomes.add(want and want[0])
    assert outcomes == {None, "project", "organization", "global"}


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_caps_counts_read_the_jobs_not_started_only_however_many_jobs_finished(project, settings):
    """A queue's table holds mostly finished jobs and a few waiting ones, the newest. The caps'
    counts at each enqueue, on the plan the server keeps for them once its statistics say so (a
    generic plan, taken again after the maintenance's ANALYZE), read the index of the jobs not
    started for the project, the organization and the total alike: not the project's finished
    jobs, not the whole table (a plan that expects to meet waiting jobs early in a table scan
    meets them at its end)."""
    from core.planner import statistics_refresh
    from jobs.services.enqueue import _waiting_depths_sql
    from core.sql import hot_cursor

    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL = 100
    Job.objects.bulk_create([Job(type="noop", organization_id=project.organization_id, project=project,
                                 state=JobState.COMPLETED, payload={}) for _ in range(5000)])
    assert "jobs_job" in statistics_refresh()  # what the workers' maintenance does as the table grows
    for _ in range(12):  # prepared by the driver, then planned generically by the server
        jobs_enqueue_many(job_type="noop", project=project, payloads=[{}])
    Job.objects.filter(state=JobState.QUEUED).delete()
    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT, settings.ORCHESTRATOR_QUEUE_MAX_GLOBAL = 10, 20
    jobs_enqueue_many(job_type="noop", project=project, payloads=[{}] * 10)
    with hot_cursor() as cursor:
        cursor.execute("SELECT name, generic_plans FROM pg_prepared_statements WHERE statement LIKE %s",
                       ["WITH t AS MATERIALIZED (SELECT (SELECT COUNT(*)%"])
        name, generic = cursor.fetchone()
    assert generic >= 1  # the server plans it generically
    arguments = {"project": project.pk, "organization": project.organization_id, "project_limit": 11,
                 "organization_limit": 11, "total_limit": 21, "project_passing": 0, "organization_passing": 0}
    order = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", _waiting_depths_sql())))
    values = ", ".join(str(arguments[key]) for key in order)
    with connection.cursor() as cursor:
        cursor.execute(f'EXPLAIN (ANALYZE, COSTS OFF) EXECUTE "{name}"({values})')
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert plan.count("using job_not_started_scope_idx on jobs_job") == 3, plan
    assert "Seq Scan" not in plan and "job_project_id_idx" not in plan, plan
    with pytest.raises(QueueFull) as refused:  # the total is past the project's cap: its own count read
        jobs_enqueue_many(job_type="noop", project=project, payloads=[{}])
    assert refused.value.extra["scope"] == "project" and " 10 jobs waiting (cap 10)" in str(refused.value.detail)
