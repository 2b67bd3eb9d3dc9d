"""The diagnosis job types (seed 003's two types, carried into runs), registered at start-up.

``failure_explain`` (background, ``drop_duplicate`` by run, step and attempt) writes the
explanation of a failed step attempt into its placeholder row; ``suggest_action``
(interactive, ``single_flight`` per run) computes the next action an operator should take.
Both run in their project's lane: one at a time per project, suggestions first, explanations
not starved (the queue's aging guard).
"""

from __future__ import annotations

import logging

from core.errors import ValidationFailed
from jobs.registry import Dedupe, JobDefinition, RetryPolicy, register

logger = logging.getLogger("orchestrator.diagnosis")

EXPLAIN_TIMEOUT_S = 30
SUGGEST_TIMEOUT_S = 30
SUGGEST_PRIORITY = 50  # an operator is waiting: ahead of run work of the default priority


def _positive_ints(payload: dict, *keys: str) -> dict:
    errors = {}
    for key in keys:
        value = payload.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            errors[f"payload.{key}"] = ["a positive integer"]
    if errors:
        raise ValidationFailed("invalid payload", errors=errors)
    return payload


def _validate_explain(payload: dict) -> dict:
    return _positive_ints(payload, "explanation", "run", "step", "attempt")


def _validate_suggest(payload: dict) -> dict:
    return _positive_ints(payload, "run")


def _explain(ctx, payload: dict) -> dict:
    """Compute the explanation from the rows and upsert it under its stable id."""
    from diagnosis.analysis import failure_facts, failure_text
    from diagnosis.models import Explanation
    from diagnosis.services import explanation_finish

    explanation = Explanation.objects.filter(pk=payload["explanation"]).first()
    if explanation is None:
        return {"explanation": None, "skipped": "its run or step attempt no longer exists"}
    if explanation.status == Explanation.Status.SUMMARY:
        return {"explanation": explanation.stable_id, "skipped": "already summarized"}
    facts = failure_facts(attempt_id=explanation.step_attempt_id, decision=explanation.engine_decision or None)
    ctx.check_cancelled()
    explanation = explanation_finish(explanation_id=explanation.pk, text=failure_text(facts), facts=facts,
                                     job_id=ctx.job_id)
    return {"explanation": explanation.stable_id, "status": explanation.status}


def _suggest(ctx, payload: dict) -> dict:
    """Compute the suggestion for the run and store it on the request's row."""
    from diagnosis.analysis import suggestion_compute
    from diagnosis.models import Suggestion
    from diagnosis.services import suggestion_as_dict, suggestion_complete

    suggestion = Suggestion.objects.filter(job_id=ctx.job_id).first()
    if suggestion is None:
        return {"suggestion": None, "skipped": "no request recorded for this job"}
    result = suggestion_compute(run_id=payload["run"])
    ctx.check_cancelled()
    suggestion = suggestion_complete(suggestion_id=suggestion.pk, result=result)
    return suggestion_as_dict(suggestion)


def _explain_ended(job) -> None:
    from diagnosis.services import explanation_job_ended

    try:
        explanation_job_ended(job)
    except Exception:  # an after-commit hook: never raise into the queue
        logger.exception("could not summarize the explanation of job %s", job.pk)


def _suggest_ended(job) -> None:
    from diagnosis.services import suggestion_job_ended

    try:
        suggestion_job_ended(job)
    except Exception:  # an after-commit hook: never raise into the queue
        logger.exception("could not record the end of suggestion job %s", job.pk)


FAILURE_EXPLAIN = register(JobDefinition(
    type="failure_explain", run=_explain, validate=_validate_explain, priority_class="background",
    dedupe=Dedupe("drop_duplicate", key=lambda payload, project_id: f"{payload['run']}:{payload['step']}:"
                                                                    f"{payload['attempt']}"),
    retry=RetryPolicy(max_attempts=3), timeout_s=EXPLAIN_TIMEOUT_S,
    on_failed=_explain_ended, on_cancelled=_explain_ended,
))

SUGGEST_ACTION = register(JobDefinition(
    type="suggest_action", run=_suggest, validate=_validate_suggest, priority_class="interactive",
    priority=SUGGEST_PRIORITY, dedupe=Dedupe("single_flight", key=lambda payload, project_id: f"{payload['run']}"),
    retry=RetryPolicy(max_attempts=2), timeout_s=SUGGEST_TIMEOUT_S,
    on_failed=_suggest_ended, on_cancelled=_suggest_ended,
))
