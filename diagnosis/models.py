"""Diagnosis rows: an explanation per failed step attempt, and operators' suggested next actions.

Both are written only by ``diagnosis/services.py``. An ``Explanation`` has a stable identity
(run, step, attempt number: a unique constraint), so however often its job is retried,
recovered or re-requested there is one row, upserted in place. A ``Suggestion`` records what
the run looked like when it was asked for, so a page can say it is stale once the run moved on.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django_fsm import FSMField

from core.fsm import ConcurrentTransitions, StateMove
from core.models import Organization


class Explanation(ConcurrentTransitions, models.Model):
    """Why one step attempt failed and what the engine did about it.

    ``explaining`` (the placeholder, shown at once) → ``final`` (computed text and facts), or
    → ``summary`` (a one-line account when the explaining job failed or was cancelled).
    """

    class Status(models.TextChoices):
        EXPLAINING = "explaining", "Explaining…"
        FINAL = "final", "Explained"
        SUMMARY = "summary", "Not explained"

    id = models.BigAutoField(primary_key=True)
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="+")
    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="explanations")
    step = models.ForeignKey("runs.Step", on_delete=models.CASCADE, related_name="explanations")
    step_attempt = models.OneToOneField("runs.StepAttempt", on_delete=models.CASCADE, related_name="explanation")
    attempt_number = models.PositiveIntegerField(help_text="the step attempt's number")
    error_code = models.CharField(max_length=100, blank=True, default="")
    status = FSMField(max_length=16, choices=Status.choices, default=Status.EXPLAINING, protected=True)
    text = models.TextField(blank=True, default="")
    facts = models.JSONField(default=dict, blank=True, help_text="what the text was computed from")
    engine_decision = models.JSONField(default=dict, blank=True,
                                       help_text="what the engine decided, read right after the failure")
    job = models.ForeignKey("jobs.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    explained_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "id"]
        constraints = [
            models.UniqueConstraint(fields=["run", "step", "attempt_number"], name="explanation_one_per_step_attempt"),
        ]
        indexes = [models.Index(fields=["organization", "error_code"], name="explanation_org_code_idx")]

    def __str__(self) -> str:
        return self.stable_id

    @property
    def stable_id(self) -> str:
        """The row's id in the run's timeline: the same for every write of this explanation."""
        return f"explanation-{self.run_id}-{self.step_id}-{self.attempt_number}"

    finish = StateMove(status, source=[Status.EXPLAINING, Status.FINAL], target=Status.FINAL)
    summarize = StateMove(status, source=Status.EXPLAINING, target=Status.SUMMARY)


class Suggestion(ConcurrentTransitions, models.Model):
    """A suggested next action on a run, asked for by an operator and computed by a job.

    ``run_status`` and ``run_version`` are the run as it was when asked: once the run's
    version differs, the suggestion is stale.
    """

    class Status(models.TextChoices):
        PENDING = "pending", "Working on it"
        READY = "ready"
        FAILED = "failed", "Not available"

    id = models.BigAutoField(primary_key=True)
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="+")
    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="suggestions")
    job = models.OneToOneField("jobs.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                     related_name="+")
    requested_at = models.DateTimeField(auto_now_add=True)
    run_status = models.CharField(max_length=16, help_text="the run's status when asked")
    run_version = models.CharField(max_length=64, help_text="digest of the run's state when asked")
    status = FSMField(max_length=16, choices=Status.choices, default=Status.PENDING, protected=True)
    action = models.CharField(max_length=32, blank=True, default="",
                              help_text="retry, recover, approve_gate, refund, escalate, resume, start, topup, "
                                        "wait or none")
    text = models.TextField(blank=True, default="")
    facts = models.JSONField(default=dict, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["run", "-id"], name="suggestion_run_idx")]
        permissions = [("request_suggestion", "Can ask for a suggested next action on a run")]

    def __str__(self) -> str:
        return f"suggestion {self.pk} for run {self.run_id} ({self.status})"

    complete = StateMove(status, source=Status.PENDING, target=Status.READY)
    fail = StateMove(status, source=Status.PENDING, target=Status.FAILED)
