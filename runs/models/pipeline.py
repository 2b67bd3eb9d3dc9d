"""Gated pipelines (DESIGN §4, seed 002): approvals, phases, gate receipts, context pins, drift
and the phases' idempotency keys."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from runs.models.hierarchy import Step, StepAttempt, Task
from runs.models.run import Run


class ApprovalRequest(models.Model):
    """A sovereign gate waiting for a human: the run pauses until an approval names the gate
    and an approval reference that no other run or gate has used."""

    class Status(models.TextChoices):
        PENDING = "pending"
        APPROVED = "approved"
        VOIDED = "voided"

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="approval_requests")
    attempt_number = models.PositiveIntegerField()
    gate = models.CharField(max_length=200)
    step = models.ForeignKey(Step, on_delete=models.CASCADE, related_name="approval_requests")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING, db_index=True)
    asked = models.JSONField(default=dict, blank=True, help_text="what the approver is asked, and the pins then")
    requested_at = models.DateTimeField(auto_now_add=True)
    approval_ref = models.CharField(max_length=300, null=True, blank=True, unique=True)
    approved_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                    related_name="+")
    approved_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "id"]
        constraints = [
            models.UniqueConstraint(fields=["run", "attempt_number", "gate"], name="approval_one_per_gate_attempt"),
        ]

    def __str__(self) -> str:
        return f"approval {self.gate} of run {self.run_id} ({self.status})"


class PhaseRecord(models.Model):
    """A phase of a gated pipeline (one task of the plan) in one attempt: when it ran, its soft cap,
    how much running time it used (the attempt's running clock at its start and end) and its result."""

    class Result(models.TextChoices):
        RUNNING = "running"
        PASSED = "passed"
        FAILED = "failed"

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="phase_records")
    attempt_number = models.PositiveIntegerField()
    task = models.OneToOneField(Task, on_delete=models.CASCADE, related_name="phase_record")
    name = models.CharField(max_length=200)
    result = models.CharField(max_length=16, choices=Result.choices, default=Result.RUNNING)
    soft_cap_minutes = models.FloatField(null=True, blank=True)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    active_ms_at_start = models.BigIntegerField(default=0)
    active_ms_at_end = models.BigIntegerField(null=True, blank=True)
    cap_escalated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "attempt_number", "started_at", "id"]

    def __str__(self) -> str:
        return f"phase {self.name} of run {self.run_id} ({self.result})"

    @property
    def active_ms(self) -> int | None:
        """Running time used by a finished phase (None while it runs)."""
        if self.active_ms_at_end is None:
            return None
        return max(0, self.active_ms_at_end - self.active_ms_at_start)


class GateReceipt(models.Model):
    """What an internal gate found: each invariant and whether it held, the pins verified first,
    when it ran. ``gate`` receipts come from a check step (one per step attempt); ``revalidation``
    receipts from re-checking the last passed gate when a stopped run resumes."""

    class Kind(models.TextChoices):
        GATE = "gate"
        REVALIDATION = "revalidation", "Revalidation on resume"

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="gate_receipts")
    attempt_number = models.PositiveIntegerField()
    phase = models.ForeignKey(PhaseRecord, null=True, blank=True, on_delete=models.SET_NULL, related_name="receipts")
    step = models.ForeignKey(Step, on_delete=models.CASCADE, related_name="gate_receipts")
    step_attempt = models.OneToOneField(StepAttempt, null=True, blank=True, on_delete=models.CASCADE,
                                        related_name="gate_receipt")
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.GATE)
    gate = models.CharField(max_length=200)
    check_name = models.CharField(max_length=100)
    args = models.JSONField(default=dict, blank=True)
    invariants = models.JSONField(default=dict, blank=True, help_text="invariant → held")
    details = models.JSONField(default=dict, blank=True, help_text="the values the invariants were judged on")
    passed = models.BooleanField()
    mode = models.CharField(max_length=8, default="live")
    pins = models.JSONField(default=dict, blank=True, help_text="the pins verified before the gate")
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()

    class Meta:
        ordering = ["run_id", "id"]
        indexes = [models.Index(fields=["run", "attempt_number", "kind"], name="gate_receipt_run_idx")]

    def __str__(self) -> str:
        return f"{self.kind} {self.gate} of run {self.run_id} ({'passed' if self.passed else 'failed'})"

    @property
    def broken(self) -> list[str]:
        return [name for name, held in (self.invariants or {}).items() if not held]


class ContextPin(models.Model):
    """A named value a run depends on (a digest, a count, a version), recorded when the pipeline
    begins or when a step produces it, and recomputed by its provider before every internal gate.
    A pin is never changed: acknowledging drift supersedes it with a new row (actor and reason)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="context_pins")
    attempt_number = models.PositiveIntegerField()
    dimension = models.CharField(max_length=100)
    provider = models.CharField(max_length=50)
    args = models.JSONField(default=dict, blank=True)
    value = models.JSONField(null=True, blank=True)
    source = models.CharField(max_length=250, help_text="start, step:<name> or acknowledged")
    recorded_at = models.DateTimeField()
    recorded_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                    related_name="+")
    actor_label = models.CharField(max_length=150, default="system")
    reason = models.TextField(blank=True, default="")
    superseded_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "attempt_number", "dimension", "id"]
        constraints = [
            models.UniqueConstraint(fields=["run", "attempt_number", "dimension"],
                                    condition=models.Q(superseded_at__isnull=True), name="context_pin_one_current"),
        ]

    def __str__(self) -> str:
        return f"pin {self.dimension} of run {self.run_id}"


class DriftRecord(models.Model):
    """A pin (or the last passed gate's invariant) that no longer holds: the run stopped as
    ``stopped_drift:<dimension>`` until an operator acknowledges it with a reason."""

    class Kind(models.TextChoices):
        PIN = "pin"
        INVARIANT = "invariant", "Gate invariant"

    class Status(models.TextChoices):
        OPEN = "open"
        ACKNOWLEDGED = "acknowledged"

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="drift_records")
    attempt_number = models.PositiveIntegerField()
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.PIN)
    dimension = models.CharField(max_length=250)
    recorded = models.JSONField(null=True, blank=True)
    live = models.JSONField(null=True, blank=True)
    detected_before = models.CharField(max_length=250, blank=True, default="",
                                       help_text="the gate it was found before (or resume)")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.OPEN, db_index=True)
    detected_at = models.DateTimeField()
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    acknowledged_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                        related_name="+")
    actor_label = models.CharField(max_length=150, blank=True, default="")
    reason = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["run_id", "id"]

    def __str__(self) -> str:
        return f"drift {self.dimension} of run {self.run_id} ({self.status})"


class PipelineKey(models.Model):
    """A phase's idempotency key (the plan's ``idempotency_key`` of a task, or one made from the
    run and the phase). A key is held by one run at a time; voiding the run releases it."""

    key = models.CharField(max_length=250)
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="pipeline_keys")
    phase = models.CharField(max_length=200)
    claimed_at = models.DateTimeField()
    released_at = models.DateTimeField(null=True, blank=True)
    released_reason = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["run_id", "id"]
        constraints = [
            models.UniqueConstraint(fields=["key"], condition=models.Q(released_at__isnull=True),
                                    name="pipeline_key_one_holder"),
        ]

    def __str__(self) -> str:
        return f"key {self.key} of run {self.run_id}"
