"""A worker process's start: its own recycling count (so that the workers of a cluster are not
replaced together), the claim planned ahead of its first claim, and the job table's indexes."""

from __future__ import annotations

import gc

import pytest
from django.db import OperationalError, connection
from django_q.conf import Conf

from jobs.models import Job, JobState
from jobs.services import claim_warm, job_enqueue, jobs_claim
from jobs import worker
from jobs.worker import recycle_spread


@pytest.fixture
def recycle_restored():
    before = Conf.RECYCLE
    yield
    Conf.RECYCLE = before


def test_each_worker_process_gets_its_own_recycling_count_within_the_spread(settings, recycle_restored):
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "recycle": 1000}
    settings.ORCHESTRATOR_Q_RECYCLE_SPREAD = 50
    counts = {recycle_spread(seed) for seed in range(200)}
    assert min(counts) >= 1000 and max(counts) <= 1500
    assert len(counts) > 100  # drawn per process: two workers of a cluster almost never share one
    assert Conf.RECYCLE == recycle_spread(199)  # django-q2's worker loop reads the count it keeps


def test_without_a_spread_every_worker_keeps_the_configured_count(settings, recycle_restored):
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "recycle": 500}
    settings.ORCHESTRATOR_Q_RECYCLE_SPREAD = 0
    assert {recycle_spread(seed) for seed in range(20)} == {500}


@pytest.mark.django_db
def test_planning_the_claim_ahead_claims_and_locks_nothing(project, define_job, settings):
    settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY = 4
    define_job(type="warm", run=lambda ctx, p: None)
    job = job_enqueue(job_type="warm", project=project, payload={}).job
    claim_warm()
    assert Job.objects.get(pk=job.pk).state == JobState.QUEUED
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()")
            assert cursor.fetchone()[0] == 0
    assert [claimed.pk for claimed in jobs_claim(worker="w1", limit=4)] == [job.pk]


@pytest.mark.django_db
def test_the_job_table_keeps_its_foreign_keys_without_single_column_indexes_on_them():
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, Job._meta.db_table)
    foreign = {tuple(c["columns"]): c["foreign_key"] for c in constraints.values() if c["foreign_key"]}
    assert foreign[("organization_id",)][0] == "core_organization"
    assert foreign[("project_id",)][0] == "core_project"
    single = {tuple(c["columns"]) for c in constraints.values() if c["index"] and not c["foreign_key"]
              and not c["primary_key"] and len(c["columns"]) == 1}
    assert not single & {("organization_id",), ("project_id",), ("type",)}
    # the composite indexes that serve those lookups are there
    leading = {c["columns"][0] for c in constraints.values() if c["index"] and len(c["columns"]) > 1}
    assert {"organization_id", "project_id", "type"} <= leading


def test_a_new_worker_process_freezes_what_it_inherited_and_plans_its_claim(settings, monkeypatch, recycle_restored):
    planned, started = [], []
    monkeypatch.setattr("jobs.services.claim_warm", lambda: planned.append(True))
    monkeypatch.setattr(worker, "ensure_started", lambda: started.append(True))
    try:
        settings.ORCHESTRATOR_QUEUE_WARM_AT_START = True
        worker.process_started()
        assert gc.get_freeze_count() > 1000  # the process's objects are out of the collector's view
        assert planned == [True] and started == [True]
        settings.ORCHESTRATOR_QUEUE_WARM_AT_START = False
        worker.process_started()
        assert planned == [True] and started == [True, True]
    finally:
        gc.unfreeze()


def test_a_worker_whose_database_is_down_at_start_still_starts(settings, monkeypatch, recycle_restored):
    def down():
        raise OperationalError("connection refused")

    monkeypatch.setattr("jobs.services.claim_warm", down)
    started = []
    monkeypatch.setattr(worker, "ensure_started", lambda: started.append(True))
    settings.ORCHESTRATOR_QUEUE_WARM_AT_START = True
    try:
        worker.process_started()
    finally:
        gc.unfreeze()
    assert started == [True]
