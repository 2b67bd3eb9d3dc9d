"""``{% diagnosis_panel run %}``: the run page's diagnosis panel, in three queries whatever the run's size."""

from __future__ import annotations

from django import template
from django.contrib.admin.utils import quote
from django.urls import reverse

from diagnosis.admin import SUGGEST_PERMISSION
from diagnosis.models import Explanation, Suggestion
from diagnosis.services import PLACEHOLDER_TEXT, explanation_display, one_line, suggestion_as_dict
from runs.models import StepAttempt

register = template.Library()

FAILURES_SHOWN = 50
STATUS_LABELS = dict(Explanation.Status.choices)


def _failure_rows(run) -> list[dict]:
    attempts = list(StepAttempt.objects.filter(run=run, outcome=StepAttempt.Outcome.FAILED)
                    .select_related("step__task__agent").order_by("-finished_at", "-id")[:FAILURES_SHOWN])
    explanations = {explanation.step_attempt_id: explanation for explanation in
                    Explanation.objects.filter(step_attempt__in=[attempt.pk for attempt in attempts])
                    .select_related("job")}
    rows = []
    for attempt in reversed(attempts):
        step = attempt.step
        explanation = explanations.get(attempt.pk)
        if explanation is not None:
            status, text = explanation_display(explanation)
            stable_id = explanation.stable_id
        else:
            status, text = "", "no explanation was requested for this failure"
            stable_id = f"explanation-{run.pk}-{step.pk}-{attempt.number}"
        rows.append({
            "stable_id": stable_id, "status": status, "status_label": STATUS_LABELS.get(status, "—"),
            "text": text or PLACEHOLDER_TEXT, "finished_at": attempt.finished_at,
            "headline": one_line(f"step {step.name} (task {step.task.name}, agent {step.task.agent.name}, run attempt "
                                 f"{step.task.agent.attempt_number}) attempt {attempt.number} failed: "
                                 f"{attempt.error_code or 'error'}: {attempt.error}", 240),
        })
    return rows


@register.inclusion_tag("admin/diagnosis/run_panel.html", takes_context=True)
def diagnosis_panel(context, run):
    request = context.get("request")
    user = getattr(request, "user", None)
    suggestion = Suggestion.objects.select_related("requested_by").filter(run=run).order_by("-id").first()
    opts = run._meta
    return {
        "run": run,
        "rows": _failure_rows(run),
        "suggestion": suggestion_as_dict(suggestion, run=run) if suggestion else None,
        "can_suggest": bool(user is not None and user.has_perm(f"{opts.app_label}.view_{opts.model_name}")
                            and user.has_perm(SUGGEST_PERMISSION)),
        "suggest_url": reverse(f"admin:{opts.app_label}_{opts.model_name}_suggest", args=[quote(run.pk)]),
        "csrf_token": context.get("csrf_token"),
        "failures_shown": FAILURES_SHOWN,
    }
