"""``failure_explain``: a failed step attempt gets one explanation row under a stable id, a
placeholder at once, then a text computed from the rows; never a second row, whatever repeats."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from core.models import Event
from diagnosis.models import Explanation
from diagnosis.services import PLACEHOLDER_TEXT, explanation_request
from jobs.models import Job, JobReason, JobState
from jobs.services import job_cancel, job_claim, jobs_recover_expired
from runs import services
from runs.models import Run, StepAttempt
from tests.diagnosis.conftest import current_step, drill, echo, one_task_plan, running_run
from tests.drive import drain_jobs

pytestmark = pytest.mark.django_db


def explain_jobs():
    return Job.objects.filter(type="failure_explain")


def explanation_of(attempt: StepAttempt) -> Explanation:
    return Explanation.objects.get(step_attempt=attempt)


def drain_explanations():
    drain_jobs(until=lambda: not explain_jobs().exclude(state__in=["completed", "failed", "cancelled"]).exists())


def test_a_failed_attempt_shows_a_placeholder_then_a_computed_explanation(project, fail_step, clock):
    run = running_run(project, one_task_plan(drill("s0"), echo("s1"), bystander=True))

    first = fail_step(run, "s0", took_ms=30)
    placeholder = explanation_of(first)
    assert placeholder.status == Explanation.Status.EXPLAINING and placeholder.text == PLACEHOLDER_TEXT
    step = first.step
    assert placeholder.stable_id == f"explanation-{run.pk}-{step.pk}-1"
    assert placeholder.engine_decision["decision"] == "retry" and placeholder.engine_decision["try"] == 1
    event = Event.objects.filter(run_id=run.pk, type="diagnosis_explanation").get()
    assert event.payload["explanation"]["id"] == placeholder.stable_id
    assert event.payload["explanation"]["status"] == "explaining"
    assert "step s0 (task t0, agent a0) attempt 1 failed: drill_retryable" in event.payload["failure"]
    job = explain_jobs().get()
    assert (job.state, job.priority_class, job.run_id) == (JobState.QUEUED, "background", run.pk)

    drain_explanations()
    explained = explanation_of(first)
    assert explained.status == Explanation.Status.FINAL and explained.pk == placeholder.pk
    facts = explained.facts
    assert facts["error"]["code"] == "drill_retryable" and facts["error"]["retryable"] is True
    assert facts["error"]["class"] == "transient"
    delay = placeholder.engine_decision["retry_in_ms"]
    assert 90 <= delay <= 110  # seed 001: 100 ms ±10 %
    assert facts["engine"]["decision"] == "retry" and facts["engine"]["retry_in_ms"] == delay
    assert facts["engine"]["tries"] == [{"number": 1, "outcome": "failed", "error_code": "drill_retryable",
                                         "retryable": True, "cost": 1, "waited_ms": None, "duration_ms": 30}]
    assert facts["propagation"][0]["level"] == "step" and len(facts["propagation"]) == 1
    assert [book["action"] for book in facts["runbooks"]] == ["wait"]
    assert explained.text.startswith("drill_retryable: transient tool error (drill), retryable — drill: it broke")
    assert f"retried after ~{delay} ms (try 1 of 3 failed)" in explained.text
    assert "Similar: no other failure with drill_retryable" in explained.text

    # Two more tries fail: the step fails, fail-fast carries it up to the run.
    second = fail_step(run, "s0", took_ms=10)
    third = fail_step(run, "s0", took_ms=10)
    drain_explanations()
    assert explanation_of(second).facts["engine"]["decision"] == "retry"
    last = explanation_of(third)
    facts = last.facts
    assert facts["engine"]["decision"] == "failed"
    assert [entry["number"] for entry in facts["engine"]["tries"]] == [1, 2, 3]
    waits = [entry["waited_ms"] for entry in facts["engine"]["tries"]]
    assert waits[0] is None and 90 <= waits[1] <= 110 and 180 <= waits[2] <= 220  # the backoffs, from the rows
    assert facts["engine"]["backoff_schedule_ms"] == [100, 200]
    chain = [(entry["level"], entry["status"]) for entry in facts["propagation"]]
    assert chain == [("step", "failed"), ("task", "failed"), ("agent", "failed"), ("run", "failed")]
    assert "failed with drill_retryable" in facts["propagation"][-1]["effect"]
    assert facts["similar"]["count"] == 2 and facts["similar"]["run_ids"] == [run.pk]
    assert facts["similar"]["projects"] == ["default"]
    assert facts["runbooks"][0]["action"] == "retry"
    assert f"retry_run {run.pk}" in facts["runbooks"][0]["command"]
    assert "Propagation: step s0: failed (retryable, tries exhausted) → task t0 (fail-fast): failed (fail-fast)" \
        in last.text
    assert "Similar: 2 other failure(s) with drill_retryable in the last 24 h, in 1 run(s)" in last.text
    assert "Runbook: retry — transient error and 2 attempt(s) left" in last.text
    assert facts["escalations"] == [{"id": facts["escalations"][0]["id"], "trigger": "retries_exhausted",
                                     "status": "open"}]
    ticket = facts["escalations"][0]["id"]
    assert f"Escalations open on the run: ticket {ticket} (retries_exhausted, open)." in last.text
    assert Explanation.objects.filter(run=run).count() == 3
    assert explain_jobs().count() == 3 and set(explain_jobs().values_list("state", flat=True)) == {"completed"}
    finals = Event.objects.filter(run_id=run.pk, type="diagnosis_explanation",
                                  payload__explanation__status="final")
    assert finals.count() == 3


def test_propagation_follows_each_levels_failure_mode(project, fail_step):
    contained = running_run(project, one_task_plan(drill("s0", mode="fatal"), echo("s1"), task_mode="continue"))
    fatal = fail_step(contained, "s0", code="drill_fatal", retryable=False)
    drain_explanations()
    facts = explanation_of(fatal).facts
    assert facts["error"] == {"code": "drill_fatal", "class": "permanent", "label": "permanent tool error (drill)",
                              "retryable": False, "message": "drill: it broke"}
    assert [(entry["level"], entry["effect"]) for entry in facts["propagation"]] == [
        ("step", "failed (not retryable)"), ("task", "continued past the failure (continue); nothing propagated")]
    assert Run.objects.get(pk=contained.pk).status == Run.Status.RUNNING
    assert [book["action"] for book in facts["runbooks"]] == ["wait"]

    replanned = running_run(project, one_task_plan(drill("s0")))
    for _ in range(3):
        exhausted = fail_step(replanned, "s0")
    drain_explanations()
    effect = explanation_of(exhausted).facts["propagation"][-1]
    assert (effect["level"], effect["status"]) == ("run", "running")
    assert effect["effect"] == "replanned instead of failing (replan 1): new agents a0/t0~replan1; now running"

    escalated = running_run(project, one_task_plan(drill("s0", mode="fatal")), max_attempts=1)
    fatal = fail_step(escalated, "s0", code="unknown_tool", message="tool 'nope' is not registered",
                      retryable=False)
    drain_explanations()
    facts = explanation_of(fatal).facts
    assert facts["error"]["class"] == "configuration"
    assert facts["propagation"][-1]["level"] == "run" and facts["propagation"][-1]["status"] == "failed"
    assert [book["action"] for book in facts["runbooks"]] == ["refund", "escalate"]
    assert "--amount 1" in facts["runbooks"][0]["command"]


def test_similar_failures_count_the_organizations_last_day_only(org_factory, fail_step, clock):
    org, project, _ = org_factory()
    other_org, other_project, _ = org_factory()
    old = running_run(project, one_task_plan(drill("s0", mode="fatal")))
    fail_step(old, "s0", code="drill_fatal", retryable=False)
    clock.advance(hours=25)
    theirs = running_run(other_project, one_task_plan(drill("s0", mode="fatal")))
    fail_step(theirs, "s0", code="drill_fatal", retryable=False)
    from core.services import project_create

    second_project = project_create(organization=org, name="second")
    ours = [running_run(p, one_task_plan(drill("s0", mode="fatal"))) for p in (project, second_project)]
    attempts = [fail_step(run, "s0", code="drill_fatal", retryable=False) for run in ours]
    drain_explanations()
    similar = explanation_of(attempts[-1]).facts["similar"]
    assert (similar["count"], similar["runs"], similar["run_ids"]) == (1, 1, [ours[0].pk])
    assert similar["projects"] == ["default"]
    # Counted up to each failure's time: computing it again later gives the same answer.
    assert explanation_of(attempts[0]).facts["similar"]["count"] == 0


def test_one_row_whatever_repeats_report_retry_recover_or_reload(project, fail_step, clock, monkeypatch,
                                                                 django_capture_on_commit_callbacks, admin_client):
    run = running_run(project, one_task_plan(drill("s0")))
    attempt = fail_step(run, "s0")
    # A second report of the same failure is a replay; a second request is dropped by the queue.
    with django_capture_on_commit_callbacks(execute=True):
        assert services.step_attempt_fail(attempt_id=attempt.pk, code="drill_retryable", message="again",
                                          retryable=True).decision == "replayed"
    explanation_request(step_attempt_id=attempt.pk)
    assert Explanation.objects.count() == 1 and explain_jobs().count() == 1
    job = explain_jobs().get()

    # The job's first try raises a transient error: retried, and still one row.
    from diagnosis import analysis

    real = analysis.failure_facts
    calls = {"n": 0}

    def flaky(**kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("database hiccup")
        return real(**kwargs)

    monkeypatch.setattr(analysis, "failure_facts", flaky)
    drain_jobs(until=lambda: Job.objects.get(pk=job.pk).state == JobState.AWAITING_TOOL)
    assert explanation_of(attempt).status == Explanation.Status.EXPLAINING
    clock.advance(seconds=1)
    drain_explanations()
    job.refresh_from_db()
    assert (job.state, job.attempts) == (JobState.COMPLETED, 2)
    assert explanation_of(attempt).status == Explanation.Status.FINAL

    # Asking again once it is explained enqueues nothing.
    explanation_request(step_attempt_id=attempt.pk)
    assert explain_jobs().count() == 1

    # A worker that wrote the row and died before finishing: recovered, run again, upserted in place.
    second = fail_step(run, "s0")
    job = explain_jobs().get(state=JobState.QUEUED)
    claimed = job_claim(worker="doomed")
    assert claimed.pk == job.pk
    from diagnosis.definitions import FAILURE_EXPLAIN
    from jobs.executor import JobContext

    FAILURE_EXPLAIN.run(JobContext(job_id=job.pk, attempt=1, worker="doomed", project_id=project.pk, run_id=run.pk,
                                   definition=FAILURE_EXPLAIN), claimed.payload)
    written = explanation_of(second)
    assert written.status == Explanation.Status.FINAL
    clock.advance(seconds=60)
    assert jobs_recover_expired() == 1
    drain_explanations()
    job.refresh_from_db()
    assert (job.state, job.attempts, job.reason) == (JobState.COMPLETED, 2, JobReason.COMPLETED)
    rewritten = explanation_of(second)
    assert rewritten.pk == written.pk and rewritten.status == Explanation.Status.FINAL
    assert Explanation.objects.filter(run=run).count() == 2

    # Reloading the run page shows each explanation once, under its stable id.
    url = reverse("admin:runs_run_change", args=[run.pk])
    for _ in range(2):
        html = admin_client.get(url).content.decode()
        assert html.count(f'id="{written.stable_id}"') == 1
        assert html.count(f'id="{explanation_of(attempt).stable_id}"') == 1
    assert Explanation.objects.filter(run=run).count() == 2


def test_a_cancelled_or_failed_job_leaves_a_one_line_summary(project, fail_step, monkeypatch,
                                                             django_capture_on_commit_callbacks):
    run = running_run(project, one_task_plan(drill("s0"), drill("s1")))
    cancelled = fail_step(run, "s0")
    job = explain_jobs().get()
    with django_capture_on_commit_callbacks(execute=True):
        job_cancel(job_id=job.pk, reason="operator: not now")
    summary = explanation_of(cancelled)
    assert summary.status == Explanation.Status.SUMMARY
    assert summary.text == f"not explained: job {job.pk} cancelled (operator: not now)"
    assert "\n" not in summary.text
    explanation_request(step_attempt_id=cancelled.pk)  # a summarized explanation is left as it is
    assert explain_jobs().count() == 1 and explanation_of(cancelled).status == Explanation.Status.SUMMARY

    from diagnosis import analysis

    def broken(**kwargs):
        raise ValueError("facts could not be read\nsecond line")

    monkeypatch.setattr(analysis, "failure_facts", broken)
    failed = fail_step(run, "s0")
    job = explain_jobs().get(state=JobState.QUEUED)
    with django_capture_on_commit_callbacks(execute=True):
        drain_explanations()
    job.refresh_from_db()
    assert (job.state, job.reason) == (JobState.FAILED, JobReason.FATAL)
    summary = explanation_of(failed)
    assert summary.status == Explanation.Status.SUMMARY
    assert summary.text == (f"not explained: job {job.pk} failed (fatal_error: ValueError: facts could not be read "
                            f"second line)")
    event = Event.objects.filter(type="diagnosis_explanation", payload__explanation__id=summary.stable_id).last()
    assert event.payload["explanation"]["status"] == "summary"


def test_a_refused_enqueue_leaves_a_summary(project, fail_step, settings):
    run = running_run(project, one_task_plan(drill("s0")))
    settings.ORCHESTRATOR_QUEUE_ENABLED = False  # once the run started (its start queues its tick)
    attempt = fail_step(run, "s0")
    explanation = explanation_of(attempt)
    assert explanation.status == Explanation.Status.SUMMARY
    assert explanation.text.startswith("not explained: queue_disabled")
    assert not explain_jobs().exists()


def test_explanations_take_at_most_a_quarter_of_the_projects_queue(project, fail_step, settings):
    settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT = 8  # two explanations may wait
    runs = [running_run(project, one_task_plan(drill("s0", mode="fatal"), bystander=True)) for _ in range(3)]
    attempts = [fail_step(run, "s0", code="drill_fatal", retryable=False) for run in runs]
    assert explain_jobs().count() == 2
    refused = explanation_of(attempts[-1])
    assert refused.status == Explanation.Status.SUMMARY
    assert refused.text == f"not explained: queue_full (2 explanations already waiting in project {project.pk})"
    drain_explanations()
    assert Explanation.objects.filter(status=Explanation.Status.FINAL).count() == 2


def test_an_explanation_whose_job_ended_without_a_word_reads_as_its_summary(project, fail_step, clock, make_staff,
                                                                           login):
    run = running_run(project, one_task_plan(drill("s0")))
    attempt = fail_step(run, "s0")
    job = explain_jobs().get()
    job_claim(worker="slow")
    job_cancel(job_id=job.pk, reason="stop")  # executing: asked to stop cooperatively
    clock.advance(seconds=10)
    from jobs.services import jobs_enforce_interrupt_timeouts

    assert jobs_enforce_interrupt_timeouts() == 1  # ended interrupt_timeout: no hook ran
    assert explanation_of(attempt).status == Explanation.Status.EXPLAINING
    expected = f"not explained: job {job.pk} cancelled (interrupt_timeout)"
    html = login(make_staff("viewer")).get(reverse("admin:runs_run_change", args=[run.pk])).content.decode()
    assert expected in html
    api = APIClient()
    api.force_authenticate(project.organization.memberships.get().user)
    rows = api.get(f"/api/v1/runs/{run.pk}/explanations/").json()["results"]
    assert [(row["id"], row["status"], row["text"]) for row in rows] == [
        (explanation_of(attempt).stable_id, "summary", expected)]


@pytest.mark.django_db(transaction=True)
def test_a_run_executed_by_the_queue_gets_every_failure_explained_once(project):
    plan = one_task_plan(drill("s0", times=2), echo("s1"))
    run = services.run_create(project=project, name="e2e", plan=plan)
    services.run_start(run_id=run.pk)
    drain_jobs(until=lambda: Run.objects.get(pk=run.pk).status == Run.Status.COMPLETED
               and not Job.objects.exclude(state__in=["completed", "failed", "cancelled"]).exists(), timeout=30)
    failed = list(StepAttempt.objects.filter(run=run, outcome=StepAttempt.Outcome.FAILED).order_by("number"))
    assert len(failed) == 2
    rows = list(Explanation.objects.filter(run=run).order_by("attempt_number"))
    assert [(row.attempt_number, row.status) for row in rows] == [(1, "final"), (2, "final")]
    assert [row.engine_decision["decision"] for row in rows] == ["retry", "retry"]
    assert rows[1].facts["engine"]["tries"][1]["waited_ms"] >= 90  # the engine waited out the first backoff
    assert explain_jobs().count() == 2
    assert timedelta(0) <= rows[0].explained_at - failed[0].finished_at


def test_a_failure_whose_process_died_before_its_after_commit_request_is_explained_by_maintenance(project, clock):
    """The explanation is requested after the failure commits; when that process dies first, the
    workers' maintenance requests it once the failure is 30 s old, and only once."""
    from jobs.worker import maintain

    run = running_run(project, one_task_plan(drill("s0"), bystander=True))
    attempt = services.step_begin(step_id=current_step(run.pk, "s0").pk)
    # No after-commit callback runs here: the process "died" between the commit and the hook.
    services.step_attempt_fail(attempt_id=attempt.pk, code="drill_retryable", message="drill: it broke",
                               retryable=True)
    assert not Explanation.objects.exists()

    clock.advance(seconds=10)
    maintain()
    assert not Explanation.objects.exists()  # its own request may still come

    clock.advance(seconds=25)
    maintain()
    explanation = Explanation.objects.get()
    assert (explanation.step_attempt_id, explanation.status) == (attempt.pk, Explanation.Status.EXPLAINING)
    assert explain_jobs().count() == 1

    clock.advance(seconds=5)
    maintain()
    assert Explanation.objects.count() == 1 and explain_jobs().count() == 1
    drain_explanations()
    assert explanation_of(StepAttempt.objects.get(pk=attempt.pk)).status == Explanation.Status.FINAL
