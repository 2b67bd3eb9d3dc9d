"""The only writers of explanations and suggestions.

Each service locks its row, moves the status through the model's transitions and writes an
event in the same transaction, so live pages update in place: ``diagnosis_explanation``
carries an explanation under its stable id, ``diagnosis_suggestion`` a suggestion (both with
the run id, so subscribers of the run receive them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.errors import DomainError, NotFound
from core.services import event_record, row_lock, transition_log
from core.timefmt import isoformat_or_none
from diagnosis.analysis import SuggestionResult, engine_decision, run_version
from diagnosis.errors import ExplainBacklogFull
from diagnosis.events import EXPLANATION_EVENT, SUGGESTION_EVENT
from diagnosis.models import Explanation, Suggestion
from jobs.models import WAITING_JOB_STATES, Job, JobState
from jobs.services import job_as_dict, job_enqueue
from runs.models import Run, StepAttempt

logger = logging.getLogger("orchestrator.diagnosis")

FAILURE_EXPLAIN = "failure_explain"
SUGGEST_ACTION = "suggest_action"
PLACEHOLDER_TEXT = "explaining…"
SUMMARY_MAX_CHARS = 300
EXPLAIN_BACKLOG_MAX = 25  # waiting failure_explain jobs per project, at most
BACKFILL_AFTER_S = 30  # a failure's own after-commit request has had its chance by then
BACKFILL_WINDOW_S = 3_600  # older failures are not explained after the fact
BACKFILL_BATCH = 50


def one_line(text: str, limit: int = SUMMARY_MAX_CHARS) -> str:
    line = " ".join((text or "").split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


# --- explanations ---------------------------------------------------------------------------

def explanation_as_dict(explanation: Explanation, *, facts: bool = True) -> dict[str, Any]:
    """An explanation as the API, the events and the live page see it (``id`` is the stable id)."""
    status, text = explanation_display(explanation)
    data = {
        "id": explanation.stable_id,
        "run": explanation.run_id,
        "step": explanation.step_id,
        "step_attempt": explanation.step_attempt_id,
        "attempt": explanation.attempt_number,
        "error_code": explanation.error_code,
        "status": status,
        "text": text,
        "job": explanation.job_id,
        "created_at": isoformat_or_none(explanation.created_at),
        "updated_at": isoformat_or_none(explanation.updated_at),
        "explained_at": isoformat_or_none(explanation.explained_at),
    }
    if facts:
        data["facts"] = explanation.facts
    return data


def _failure_headline(attempt: StepAttempt) -> str:
    step = attempt.step
    return one_line(f"step {step.name} (task {step.task.name}, agent {step.task.agent.name}) attempt {attempt.number} "
                    f"failed: {attempt.error_code or 'error'}: {attempt.error}", 240)


def _emit_explanation(explanation: Explanation, *, project_id: int, headline: str = "") -> None:
    payload = {"explanation": explanation_as_dict(explanation, facts=False)}
    if headline:
        payload["failure"] = headline
    event_record(type=EXPLANATION_EVENT, organization_id=explanation.organization_id, project_id=project_id,
                 run_id=explanation.run_id, payload=payload)
    transition_log(entity="explanation", id=explanation.stable_id, run=explanation.run_id, to=explanation.status)




def explain_backlog_cap() -> int:
    return max(1, min(EXPLAIN_BACKLOG_MAX, settings.ORCHESTRATOR_QUEUE_MAX_PER_PROJECT // 4))


def _explain_backlog_check(project_id: int) -> None:
    waiting = Job.objects.filter(type=FAILURE_EXPLAIN, project_id=project_id,
                                 state__in=list(WAITING_JOB_STATES)).count()
    if waiting >= explain_backlog_cap():
        raise ExplainBacklogFull(f"{waiting} explanations already waiting in project {project_id}")


def _placeholder(attempt: StepAttempt) -> Explanation:
    """The attempt's explanation row, created ``explaining…`` (with its event) when it is new."""
    run = attempt.run
    explanation, created = Explanation.objects.get_or_create(
        run=run, step=attempt.step, attempt_number=attempt.number,
        defaults={"organization_id": run.organization_id, "step_attempt": attempt, "error_code": attempt.error_code,
                  "text": PLACEHOLDER_TEXT, "engine_decision": engine_decision(attempt, attempt.step)})
    if created:
        _emit_explanation(explanation, project_id=run.project_id, headline=_failure_headline(attempt))
    return explanation


def explanation_request(*, step_attempt_id: int) -> Explanation | None:
    """A failed step attempt gets its explanation: the placeholder row at once (``explaining…``)
    and, in the same transaction, a ``failure_explain`` job that writes the final text. Called
    after the failure commits.

    Idempotent: the row is unique per (run, step, attempt) and the job is ``drop_duplicate``
    on the same key, so a second request for the same attempt changes nothing; an explanation
    already final or summarized is left alone. A queue that refuses the job (full, disabled)
    leaves the row with a one-line summary instead. Returns None for an attempt that did not fail.
    """
    attempt = (StepAttempt.objects.select_related("run__project", "step__task__agent")
               .filter(pk=step_attempt_id).first())
    if attempt is None or attempt.outcome != StepAttempt.Outcome.FAILED:
        return None
    run = attempt.run
    try:
        with transaction.atomic():
            explanation = _placeholder(attempt)
            if explanation.status != Explanation.Status.EXPLAINING:
                return explanation
            if explanation.job_id is None:
                _explain_backlog_check(run.project_id)
            job = job_enqueue(job_type=FAILURE_EXPLAIN, project=run.project, run_id=run.pk,
                              payload={"explanation": explanation.pk, "run": run.pk, "step": attempt.step_id,
                                       "attempt": attempt.number}).job
            if explanation.job_id != job.pk:
                Explanation.objects.filter(pk=explanation.pk).update(job=job)
                explanation.job_id = job.pk
            return explanation
    except DomainError as exc:  # queue full or disabled: the row says so instead of explaining
        with transaction.atomic():
            explanation = _placeholder(attempt)
        return explanation_summarize(explanation_id=explanation.pk,
                                     summary=f"not explained: {exc.code} ({exc.detail})")


def explanations_backfill(*, now=None) -> int:
    """Request the explanations a failure's after-commit hook never asked for (its process
    ended between the failure's commit and the hook): failed attempts of the last hour, at least
    ``BACKFILL_AFTER_S`` old, with no explanation row. A maintenance duty; returns how many."""
    from datetime import timedelta

    from django.db.models import Exists, OuterRef

    now = now or timezone.now()
    explained = Explanation.objects.filter(run_id=OuterRef("run_id"), step_id=OuterRef("step_id"),
                                           attempt_number=OuterRef("number"))
    missing = list(StepAttempt.objects
                   .filter(outcome=StepAttempt.Outcome.FAILED,
                           finished_at__gte=now - timedelta(seconds=BACKFILL_WINDOW_S),
                           finished_at__lt=now - timedelta(seconds=BACKFILL_AFTER_S))
                   .exclude(Exists(explained)).order_by("finished_at").values_list("pk", flat=True)[:BACKFILL_BATCH])
    for attempt_id in missing:
        explanation_request_quietly(attempt_id)
    if missing:
        logger.warning("requested %s explanations a failure's own request never made", len(missing))
    return len(missing)


def explanation_request_quietly(step_attempt_id: int) -> None:
    """``explanation_request`` for the run engine's after-commit hook: never raises into it."""
    try:
        explanation_request(step_attempt_id=step_attempt_id)
    except Exception:
        logger.exception("could not request an explanation of step attempt %s", step_attempt_id)


@transaction.atomic
def explanation_finish(*, explanation_id: int, text: str, facts: dict, job_id: int | None = None) -> Explanation:
    """explaining → final with the computed text and facts (final → final replaces them: an
    upsert under the stable id, so a job that runs twice leaves one row). A summarized
    explanation stays as it is."""
    explanation = row_lock(Explanation, explanation_id, entity="explanation", related=("run",))
    if explanation.status == Explanation.Status.SUMMARY:
        return explanation
    explanation.finish()
    explanation.text = text
    explanation.facts = facts
    explanation.explained_at = timezone.now()
    if job_id is not None:
        explanation.job_id = job_id
    explanation.save()
    _emit_explanation(explanation, project_id=explanation.run.project_id)
    return explanation


@transaction.atomic
def explanation_summarize(*, explanation_id: int, summary: str) -> Explanation:
    """explaining → summary: a one-line account of why there is no explanation. Final or already
    summarized: unchanged."""
    explanation = row_lock(Explanation, explanation_id, entity="explanation", related=("run",))
    if explanation.status != Explanation.Status.EXPLAINING:
        return explanation
    explanation.summarize()
    explanation.text = one_line(summary)
    explanation.save()
    _emit_explanation(explanation, project_id=explanation.run.project_id)
    return explanation


def explanation_display(explanation: Explanation) -> tuple[str, str]:
    """``(status, text)`` to show: an explanation still ``explaining`` whose job ended without
    writing it (e.g. stopped past its graceful window) reads as a summary of that job."""
    job = explanation.job if explanation.job_id else None
    if explanation.status == Explanation.Status.EXPLAINING and job is not None and job.is_terminal:
        reason = f"{job.reason}: {job.error}" if job.error else job.reason
        return Explanation.Status.SUMMARY, one_line(f"not explained: job {job.pk} {job.state} ({reason})")
    return explanation.status, explanation.text


def _job_summary(job: Job, verb: str) -> str:
    detail = job.cancel_reason if verb == "cancelled" else (f"{job.reason}: {job.error}" if job.error else job.reason)
    return f"not explained: job {job.pk} {verb} ({detail or 'no reason given'})"


def explanation_job_ended(job: Job) -> None:
    """``failure_explain``'s on_failed / on_cancelled hook: the placeholder becomes a summary."""
    explanation_id = (job.payload or {}).get("explanation")
    if not explanation_id:
        return
    verb = "cancelled" if job.state == JobState.CANCELLED else "failed"
    try:
        explanation_summarize(explanation_id=explanation_id, summary=_job_summary(job, verb))
    except NotFound:
        pass  # its run was deleted meanwhile


# --- suggestions ----------------------------------------------------------------------------

def suggestion_as_dict(suggestion: Suggestion, *, run: Run | None = None) -> dict[str, Any]:
    """A suggestion with ``stale``: the run changed after the request (its version differs)."""
    run = run or suggestion.run
    current = run_version(run)
    return {
        "id": suggestion.pk,
        "run": suggestion.run_id,
        "job": suggestion.job_id,
        "status": suggestion.status,
        "action": suggestion.action,
        "text": suggestion.text,
        "facts": suggestion.facts,
        "requested_by": suggestion.requested_by.get_username() if suggestion.requested_by_id else None,
        "requested_at": isoformat_or_none(suggestion.requested_at),
        "completed_at": isoformat_or_none(suggestion.completed_at),
        "run_status_at_request": suggestion.run_status,
        "run_status": run.status,
        "stale": current != suggestion.run_version,
    }


def _emit_suggestion(suggestion: Suggestion, run: Run) -> None:
    event_record(type=SUGGESTION_EVENT, organization_id=suggestion.organization_id, project_id=run.project_id,
                 run_id=run.pk, payload={"suggestion": suggestion_as_dict(suggestion, run=run)})
    transition_log(entity="suggestion", id=suggestion.pk, run=run.pk, to=suggestion.status, action=suggestion.action)


@dataclass(frozen=True)
class SuggestionRequested:
    suggestion: Suggestion
    job: Job
    dedupe: str  # enqueued | already_queued


def suggestion_request(*, run_id: int, actor=None) -> SuggestionRequested:
    """Ask for a suggested next action on a run: a ``suggest_action`` job, single flight per run.

    While one is queued or running, asking again returns the same job and suggestion
    (``already_queued``); afterwards a new one is made. The suggestion records the run's status
    and version now, so it reads as stale once the run changes. Raises ``NotFound``,
    ``QueueFull`` or ``QueueDisabled``; nothing is written then.
    """
    run = Run.objects.select_related("project").filter(pk=run_id, deleted_at__isnull=True).first()
    if run is None:
        raise NotFound(f"run {run_id} does not exist")
    with transaction.atomic():
        result = job_enqueue(job_type=SUGGEST_ACTION, project=run.project, payload={"run": run.pk}, run_id=run.pk,
                             actor=actor)
        suggestion = Suggestion.objects.select_related("requested_by").filter(job=result.job).first()
        if suggestion is None:
            suggestion = Suggestion.objects.create(
                organization_id=run.organization_id, run=run, job=result.job,
                requested_by=actor if getattr(actor, "pk", None) else None,
                run_status=run.status, run_version=run_version(run))
            _emit_suggestion(suggestion, run)
        return SuggestionRequested(suggestion, result.job, "enqueued" if result.dedupe == "enqueued"
                                   else "already_queued")


def _suggestion_end(suggestion_id: int, move, **fields) -> Suggestion:
    """Move a pending suggestion on (``Suggestion.complete`` or ``Suggestion.fail``) with ``fields``,
    and write its event. Already ended: unchanged."""
    suggestion = row_lock(Suggestion, suggestion_id, entity="suggestion", related=("run",))
    if suggestion.status != Suggestion.Status.PENDING:
        return suggestion
    move(suggestion)
    for name, value in fields.items():
        setattr(suggestion, name, value)
    suggestion.completed_at = timezone.now()
    suggestion.save()
    _emit_suggestion(suggestion, suggestion.run)
    return suggestion


@transaction.atomic
def suggestion_complete(*, suggestion_id: int, result: SuggestionResult) -> Suggestion:
    """pending → ready with the computed action, text and facts. Already ended: unchanged."""
    return _suggestion_end(suggestion_id, Suggestion.complete, action=result.action, text=result.text,
                           facts=result.facts)


@transaction.atomic
def suggestion_fail(*, suggestion_id: int, summary: str) -> Suggestion:
    """pending → failed with a one-line summary. Already ended: unchanged."""
    return _suggestion_end(suggestion_id, Suggestion.fail, text=one_line(summary))


def suggestion_job_ended(job: Job) -> None:
    """``suggest_action``'s on_failed / on_cancelled hook."""
    suggestion = Suggestion.objects.filter(job_id=job.pk).values_list("pk", flat=True).first()
    if suggestion is None:
        return
    verb = "cancelled" if job.state == JobState.CANCELLED else "failed"
    detail = job.cancel_reason if verb == "cancelled" else (f"{job.reason}: {job.error}" if job.error else job.reason)
    suggestion_fail(suggestion_id=suggestion, summary=f"no suggestion: job {job.pk} {verb} ({detail or 'no reason'})")


def suggestion_response(requested: SuggestionRequested, job: Job) -> dict[str, Any]:
    """The body of the suggest endpoints: the job's state, the dedupe outcome, the job and the suggestion."""
    suggestion = Suggestion.objects.select_related("run", "requested_by").get(pk=requested.suggestion.pk)
    status = job.state if job.is_terminal else "queued"
    return {"status": status, "dedupe": requested.dedupe, "job": job_as_dict(job),
            "suggestion": suggestion_as_dict(suggestion)}
