"""Runs handed to a human: escalation tickets and their state groups."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django_fsm import FSMField

from core.fsm import StateMove
from core.models import Organization
from runs.models.run import Run


class EscalationTicket(models.Model):
    """A run handed to a human (seed 001 §6.2): open → acknowledged → resolved.

    One incident per run: a run has at most one unresolved ticket, which gathers every trigger that
    fired while it was open (``triggers``: ``{"trigger", "at", "detail"}`` in the order they came).
    ``trigger`` is the one that opened it.
    """

    class Status(models.TextChoices):
        OPEN = "open"
        ACKNOWLEDGED = "acknowledged"
        RESOLVED = "resolved"

    class Trigger(models.TextChoices):
        ERROR_BURST = "error_burst", "More than 5 errors in 5 minutes"
        ERROR_RATE = "error_rate", "Error rate above 50 %"
        BACKOFF_CAP = "backoff_cap", "Backoff past its cap"
        RETRIES_EXHAUSTED = "retries_exhausted", "Retryable errors exhausted their attempts"
        MANUAL = "manual", "Escalated by an operator"
        CAP = "stop_and_escalate", "A time cap was passed"

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="escalations")
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="+")
    status = FSMField(max_length=16, choices=Status.choices, default=Status.OPEN, protected=True, db_index=True)
    trigger = models.CharField(max_length=32, choices=Trigger.choices)
    severity = models.CharField(max_length=16, default="high")
    detail = models.TextField()
    triggers = models.JSONField(default=list, blank=True,
                                help_text="every trigger the ticket gathered: trigger, at (ISO time), detail")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    acknowledged_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                        related_name="+")
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                    related_name="+")
    resolution = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(fields=["run"], condition=~models.Q(status="resolved"),
                                    name="escalation_one_unresolved_per_run"),
        ]
        # manage_escalation is declared by the escalation runbooks (runs.runbooks)

    def __str__(self) -> str:
        return f"escalation {self.pk} of run {self.run_id} ({self.trigger}, {self.status})"

    acknowledge = StateMove(status, source=Status.OPEN, target=Status.ACKNOWLEDGED)
    resolve = StateMove(status, source=[Status.OPEN, Status.ACKNOWLEDGED], target=Status.RESOLVED)


OPEN_ESCALATION_STATES = (EscalationTicket.Status.OPEN, EscalationTicket.Status.ACKNOWLEDGED)
