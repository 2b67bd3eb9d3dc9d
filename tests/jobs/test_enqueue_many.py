"""Several jobs of one type queued in one transaction (``jobs_enqueue_many``): all or none."""

from datetime import datetime, timedelta, timezone as dt_timezone

import pytest
from django.db.models.signals import post_init

from core.errors import ValidationFailed
from core.models import Event, MetricDelta
from jobs.errors import QueueFull
from jobs.models import Job, JobLane, JobState
from jobs.registry import Dedupe
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
