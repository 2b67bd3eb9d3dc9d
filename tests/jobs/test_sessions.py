"""Worker sessions (seed 004): lazy creation, one-time preflight and bootstrap, the single
stale reset, hiding from users and refusing their operations."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from core.errors import NotFound, ValidationFailed
from core.models import AuditRecord, Event
from jobs import sessions
from jobs.commands.adapters import DatabaseAdapter
from jobs.errors import SystemSessionRefused
from jobs.executor import job_run_claimed
from jobs.models import Job, JobReason, JobState, WorkerSession, WorkerSessionStatus
from jobs.registry import RetryPolicy, definition_get
from jobs.services import job_claim, job_enqueue
from jobs.sessions import (
    USER_OPERATIONS,
    WorkerSessionMisconfigured,
    WorkerSessionUnavailable,
    session_bootstrap_register,
    session_preflight_register,
    worker_session_for_job,
    worker_session_list,
    worker_session_mark_stale,
    worker_session_user_operation,
)

LATER = timedelta(minutes=5)


@pytest.fixture(autouse=True)
def isolated_registries(monkeypatch):
    monkeypatch.setattr(sessions, "_PREFLIGHTS", dict(sessions._PREFLIGHTS))
    monkeypatch.setattr(sessions, "_BOOTSTRAPS", dict(sessions._BOOTSTRAPS))


class Counter:
    """A preflight or bootstrap step that counts its calls and fails the first ``fail`` ones."""

    def __init__(self, fail: int = 0):
        self.calls = []
        self.fail = fail

    def __call__(self, session, job):
        self.calls.append((session.key, session.generation, job.pk if job else None))
        if len(self.calls) <= self.fail:
            raise ConnectionError(f"worker not ready (call {len(self.calls)})")


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user(username="chat-user")  # no password: no slow hashing


@pytest.fixture
def preflight():
    step = Counter()
    session_preflight_register("tester", step)
    return step


@pytest.fixture
def agent_job(define_job):
    """Define a job type run inside the ``tester`` worker session."""

    def define(job_type="agent_turn", bootstrap_key=None, **kwargs):
        return define_job(type=job_type, session_agent="tester", bootstrap_key=bootstrap_key,
                          run=lambda ctx, payload: {"session": ctx.session.key,
                                                    "generation": ctx.session.generation},
                          **kwargs)

    return define


def run_one(project, job_type="agent_turn", now=None):
    job_enqueue(job_type=job_type, project=project, payload={})
    job = job_claim(worker="test", now=now)
    job_run_claimed(job, worker="test")
    job.refresh_from_db()
    return job


def session_events():
    return list(Event.objects.filter(type__startswith="worker_session_").order_by("id")
                .values_list("type", flat=True))


def test_a_session_is_created_lazily_on_the_first_job_and_preflighted_once(project, agent_job, preflight):
    agent_job()
    assert WorkerSession.objects.count() == 0
    first = run_one(project)
    second = run_one(project)
    key = f"project:{project.pk}::tester"
    assert first.state == second.state == JobState.COMPLETED
    assert first.result == second.result == {"session": key, "generation": 1}
    session = WorkerSession.objects.get()
    assert (session.key, session.owner, session.agent, session.project_id) == (
        key, f"project:{project.pk}", "tester", project.pk)
    assert session.system_owned and session.status == WorkerSessionStatus.READY
    assert session.preflight_at is not None and session.last_used_at is not None
    assert [generation for _, generation, _ in preflight.calls] == [1]
    assert session_events() == ["worker_session_created", "worker_session_preflight", "worker_session_ready"]


def test_two_calls_for_one_session_share_it(project, agent_job, preflight):
    definition = agent_job()
    first = job_enqueue(job_type="agent_turn", project=project, payload={}).job
    second = job_enqueue(job_type="agent_turn", project=project, payload={}).job
    assert worker_session_for_job(job=first, definition=definition).pk == \
        worker_session_for_job(job=second, definition=definition).pk
    assert WorkerSession.objects.count() == 1 and len(preflight.calls) == 1


def test_sessions_are_per_owner_and_agent(org_factory, define_job, preflight):
    session_preflight_register("other", Counter())
    _, first, _ = org_factory()
    _, second, _ = org_factory()
    tester = define_job(type="t", session_agent="tester", run=lambda ctx, p: None)
    other = define_job(type="o", session_agent="other", run=lambda ctx, p: None)
    for project in (first, second):
        for definition in (tester, other):
            job = job_enqueue(job_type=definition.type, project=project, payload={}).job
            worker_session_for_job(job=job, definition=definition)
    assert sorted(WorkerSession.objects.values_list("key", flat=True)) == sorted(
        f"project:{p.pk}::{a}" for p in (first, second) for a in ("tester", "other"))
    assert sessions.worker_session_owner(session_id="chat-7") == "session:chat-7"


def test_the_default_preflight_pings_the_execution_adapter(project, define_job, settings):
    definition = define_job(type="pinger", session_agent="no-own-preflight", run=lambda ctx, p: None)
    job = job_enqueue(job_type="pinger", project=project, payload={}).job
    assert worker_session_for_job(job=job, definition=definition).preflight_at is not None
    settings.ORCHESTRATOR_EXECUTION_ADAPTER = "tests.jobs.test_sessions.DeafAdapter"
    worker_session_mark_stale(session_key=f"project:{project.pk}::no-own-preflight")
    with pytest.raises(WorkerSessionUnavailable, match="did not answer ping"):
        worker_session_for_job(job=job, definition=definition)


class DeafAdapter(DatabaseAdapter):
    def ping(self) -> bool:
        return False


def test_a_bootstrap_runs_once_per_key(project, agent_job, preflight):
    alpha, beta = Counter(), Counter()
    session_bootstrap_register("alpha", alpha)
    session_bootstrap_register("beta", beta)
    agent_job("with_alpha", bootstrap_key="alpha")
    agent_job("with_beta", bootstrap_key="beta")
    agent_job("plain")
    for job_type in ("with_alpha", "with_alpha", "plain", "with_beta", "with_alpha", "with_beta"):
        assert run_one(project, job_type).state == JobState.COMPLETED
    assert (len(alpha.calls), len(beta.calls), len(preflight.calls)) == (1, 1, 1)
    assert WorkerSession.objects.get().bootstrap_keys == ["alpha", "beta"]


def test_an_unregistered_bootstrap_key_fails_the_job_without_retry(project, agent_job, preflight):
    agent_job(bootstrap_key="missing")
    job = run_one(project)
    assert (job.state, job.reason) == (JobState.FAILED, JobReason.FATAL)
    assert "WorkerSessionMisconfigured" in job.error
    assert WorkerSession.objects.count() == 0


def test_a_session_unused_for_too_long_is_reprovisioned_once(project, agent_job, preflight, settings):
    bootstrap = Counter()
    session_bootstrap_register("alpha", bootstrap)
    agent_job(bootstrap_key="alpha")
    run_one(project)
    settings.ORCHESTRATOR_WORKER_SESSION_STALE_S = 60
    WorkerSession.objects.update(last_used_at=timezone.now() - timedelta(seconds=61))  # time passes
    job = run_one(project)
    assert job.state == JobState.COMPLETED and job.result["generation"] == 2
    session = WorkerSession.objects.get()
    assert (session.generation, session.reprovision_count, session.status) == (2, 1, WorkerSessionStatus.READY)
    assert [generation for _, generation, _ in preflight.calls] == [1, 2]
    assert [generation for _, generation, _ in bootstrap.calls] == [1, 2]
    assert run_one(project).result["generation"] == 2  # fresh again: no further reset
    assert "worker_session_reprovisioned" in session_events()


def test_a_session_marked_stale_is_reprovisioned_on_its_next_job(project, agent_job, preflight):
    agent_job()
    run_one(project)
    key = f"project:{project.pk}::tester"
    assert worker_session_mark_stale(session_key=key, reason="thread lost").status == WorkerSessionStatus.STALE
    job = run_one(project)
    assert job.state == JobState.COMPLETED and job.result["generation"] == 2
    assert WorkerSession.objects.get().reprovision_count == 1
    with pytest.raises(NotFound):
        worker_session_mark_stale(session_key="project:0::nobody")


def test_a_failed_preflight_gets_a_single_reset_and_retry(project, agent_job):
    preflight = Counter(fail=1)
    session_preflight_register("tester", preflight)
    agent_job()
    job = run_one(project)
    assert job.state == JobState.COMPLETED and job.result["generation"] == 2
    assert [generation for _, generation, _ in preflight.calls] == [1, 2]
    assert WorkerSession.objects.get().reprovision_count == 1


def test_a_second_failure_raises_a_retryable_error(project, agent_job):
    preflight = Counter(fail=2)
    session_preflight_register("tester", preflight)
    agent_job(retry=RetryPolicy(max_attempts=3))
    job = run_one(project)
    assert (job.state, job.reason) == (JobState.AWAITING_TOOL, JobReason.RETRY_SCHEDULED)
    assert "WorkerSessionUnavailable" in job.error
    session = WorkerSession.objects.get()
    assert (session.status, session.reprovision_count, len(preflight.calls)) == (WorkerSessionStatus.FAILED, 1, 2)
    assert "worker_session_failed" in session_events()
    # The next attempt starts with one more reset, and the worker is ready by then.
    job = job_claim(worker="test", now=timezone.now() + LATER)
    job_run_claimed(job, worker="test")
    job.refresh_from_db()
    assert job.state == JobState.COMPLETED and job.attempts == 2
    session.refresh_from_db()
    assert (session.status, session.reprovision_count, session.generation) == (WorkerSessionStatus.READY, 2, 3)


def test_a_stale_session_is_reset_only_once_per_job(project, agent_job):
    preflight = Counter()
    session_preflight_register("tester", preflight)
    definition = agent_job()
    job = job_enqueue(job_type="agent_turn", project=project, payload={}).job
    worker_session_for_job(job=job, definition=definition)
    worker_session_mark_stale(session_key=f"project:{project.pk}::tester")
    preflight.fail = 99
    with pytest.raises(WorkerSessionUnavailable) as unavailable:
        worker_session_for_job(job=job, definition=definition)
    assert definition.retry.classify(unavailable.value) == "retryable"
    session = WorkerSession.objects.get()
    assert (session.reprovision_count, len(preflight.calls)) == (1, 2)  # one reset, one more preflight
    assert session.status == WorkerSessionStatus.FAILED


def test_system_sessions_are_hidden_from_user_listings(project, agent_job, preflight):
    agent_job()
    run_one(project)
    assert list(worker_session_list()) == []
    assert [s.key for s in worker_session_list(user_visible=False)] == [f"project:{project.pk}::tester"]
    assert worker_session_list(user_visible=False, owner="project:0").count() == 0


@pytest.mark.parametrize("operation", sorted(USER_OPERATIONS))
def test_user_operations_on_system_sessions_are_refused(project, agent_job, preflight, user, operation):
    agent_job()
    run_one(project)
    key = f"project:{project.pk}::tester"
    with pytest.raises(SystemSessionRefused) as refused:
        worker_session_user_operation(session_key=key, operation=operation, user=user)
    assert (refused.value.code, refused.value.status) == ("system_session", 403)
    assert refused.value.extra == {"session": key, "operation": operation}
    audit = AuditRecord.objects.get(action="worker_session_refused")
    assert audit.actor == user and audit.after == {"key": key, "operation": operation}
    assert WorkerSession.objects.filter(key=key).exists()


def test_user_operation_checks(project, user):
    user_session = WorkerSession.objects.create(key="session:chat-1::helper", owner="session:chat-1",
                                                agent="helper", system_owned=False)  # a user-owned row
    assert worker_session_user_operation(session_key=user_session.key, operation="rename",
                                         user=user) == user_session
    assert list(worker_session_list()) == [user_session]
    with pytest.raises(ValidationFailed):
        worker_session_user_operation(session_key=user_session.key, operation="explode", user=user)
    with pytest.raises(NotFound):
        worker_session_user_operation(session_key="nope::nobody", operation="send", user=user)


def test_jobs_without_a_session_agent_make_no_session(project):
    assert definition_get("noop").session_agent is None
    job_enqueue(job_type="noop", project=project, payload={})
    job = job_claim(worker="test")
    job_run_claimed(job, worker="test")
    assert Job.objects.get().state == JobState.COMPLETED
    assert WorkerSession.objects.count() == 0


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_first_jobs_create_and_preflight_one_session(project, define_job):
    preflight = Counter()
    session_preflight_register("tester", preflight)
    definition = define_job(type="racer", session_agent="tester", run=lambda ctx, p: None, lane=lambda p, pid: "")
    jobs = [job_enqueue(job_type="racer", project=project, payload={}).job for _ in range(8)]
    barrier = threading.Barrier(len(jobs))
    keys, errors = [], []

    def prepare(job):
        try:
            barrier.wait()
            keys.append(worker_session_for_job(job=job, definition=definition).pk)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=prepare, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert WorkerSession.objects.count() == 1 and len(set(keys)) == 1 and len(keys) == 8
    assert len(preflight.calls) == 1
