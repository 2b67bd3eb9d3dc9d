"""Runs and their hierarchy: Run → Agent → Task → Step, with attempts and artifacts.

Every status is a django-fsm-2 ``FSMField(protected=True)``: only the transition methods
below change it, and only the services in ``runs/services.py`` call them (under the run's
row lock). Transition methods set fields on ``self`` and nothing else.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django_fsm import ConcurrentTransitionMixin, FSMField, transition

from core.models import Organization, Project


class FailureMode(models.TextChoices):
    FAIL_FAST = "fail-fast", "Fail fast"
    CONTINUE = "continue", "Continue"
    RETRY = "retry", "Retry"


class ParallelismMode(models.TextChoices):
    SEQUENTIAL = "sequential", "Sequential"
    PARALLEL = "parallel", "Parallel"
    DAG = "dag", "DAG"


MAX_RETRIES_PER_LEVEL = 3


class RunQuerySet(models.QuerySet):
    def alive(self):
        return self.filter(deleted_at__isnull=True)


class Run(ConcurrentTransitionMixin, models.Model):
    """A top-level execution: a plan of agents, tasks and steps, billed against a reservation.

    Guarantees (kept by the services): credits ``reserved >= charged >= 0`` at every moment and
    ``charged + refunded = reserved`` in every terminal state; exactly one winner when two
    transitions race; ``failed`` is terminal once ``attempt_number == max_attempts``.
    """

    class Status(models.TextChoices):
        CREATED = "created", "Created"
        PENDING = "pending", "Pending"
        RUNNING = "running", "Running"
        PAUSED = "paused", "Paused"
        RESUMING = "resuming", "Resuming"
        COMPLETED = "completed", "Completed"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled"
        RETRYING = "retrying", "Retrying"

    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="runs")
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="runs")
    name = models.CharField(max_length=200)
    plan = models.JSONField()
    status = FSMField(max_length=16, choices=Status.choices, default=Status.CREATED, protected=True, db_index=True)
    status_reason = models.CharField(max_length=200, blank=True, default="",
                                     help_text="why the run is paused or stopped (e.g. awaiting_approval:publish)")
    mode = models.CharField(max_length=8, choices=[("live", "Live"), ("dryrun", "Dry run")], default="live",
                            help_text="dryrun: checks run, tool steps are not executed (nothing is charged)")
    gated = models.BooleanField(default=False, help_text="a gated pipeline: its plan has gates, pins or caps")
    priority = models.IntegerField(default=100, help_text="lower runs first")
    failure_mode = models.CharField(max_length=16, choices=FailureMode.choices, default=FailureMode.FAIL_FAST)
    max_agents = models.PositiveSmallIntegerField(default=10)
    attempt_number = models.PositiveIntegerField(default=1)
    max_attempts = models.PositiveIntegerField(default=3)
    credit_limit = models.BigIntegerField(help_text="credits reserved for each attempt")
    credits_reserved = models.BigIntegerField(default=0)
    credits_charged = models.BigIntegerField(default=0)
    credits_refunded = models.BigIntegerField(default=0)
    replan_count = models.PositiveIntegerField(default=0)
    last_error_code = models.CharField(max_length=100, blank=True, default="", db_index=True)
    last_error = models.TextField(blank=True, default="")
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)
    status_changed_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.BigIntegerField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)

    objects = RunQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["status", "status_changed_at"], name="run_status_changed_idx"),
            models.Index(fields=["project", "status"], name="run_project_status_idx"),
            models.Index(fields=["organization", "-id"], name="run_org_idx"),
            # The run list (newest first) filtered by status, project or error code: an index seek.
            models.Index(fields=["status", "id"], name="run_status_id_idx"),
            models.Index(fields=["project", "id"], name="run_project_id_idx"),
            models.Index(fields=["last_error_code", "id"], name="run_error_code_id_idx"),
            # Live runs newest first: the "stuck" list walks only these.
            models.Index(fields=["id"], name="run_live_id_idx", condition=models.Q(
                status__in=["pending", "running", "paused", "resuming", "retrying"])),
            # Runs not settled (the retention prune keeps their jobs and events): a few, found by index.
            models.Index(fields=["id"], name="run_unsettled_id_idx",
                         condition=~models.Q(status__in=["completed", "cancelled", "failed"])),
        ]
        constraints = [
            models.CheckConstraint(condition=models.Q(credit_limit__gt=0), name="run_credit_limit_positive"),
            models.CheckConstraint(condition=models.Q(credits_charged__gte=0), name="run_charged_not_negative"),
            models.CheckConstraint(condition=models.Q(credits_reserved__gte=models.F("credits_charged")),
                                   name="run_reserved_covers_charged"),
            models.CheckConstraint(condition=models.Q(attempt_number__lte=models.F("max_attempts")),
                                   name="run_attempt_within_max"),
        ]
        permissions = [
            ("start_run", "Can start a run"),
            ("force_fail_run", "Can force-fail a run"),
            ("cancel_run", "Can cancel a run"),
            ("pause_run", "Can pause a run"),
            ("resume_run", "Can resume a run"),
            ("retry_run", "Can retry a run"),
            ("escalate_run", "Can escalate a run"),
            ("recover_run", "Can recover stuck runs"),
            ("approve_gate", "Can approve a gate"),
            ("acknowledge_drift", "Can acknowledge the drift of a run's pins"),
            ("void_run", "Can void a stopped run"),
        ]

    def __str__(self) -> str:
        return f"run {self.pk} {self.name!r} ({self.status})"

    # --- transitions: set fields on self only ---------------------------------------------
    def has_attempts_left(self) -> bool:
        return self.attempt_number < self.max_attempts

    @transition(field=status, source=Status.CREATED, target=Status.PENDING)
    def start(self):
        pass

    @transition(field=status, source=[Status.PENDING, Status.RESUMING], target=Status.RUNNING)
    def mark_running(self):
        pass

    @transition(field=status, source=Status.RUNNING, target=Status.COMPLETED)
    def complete(self):
        pass

    @transition(field=status, source=[Status.PENDING, Status.RUNNING, Status.RESUMING, Status.RETRYING],
                target=Status.FAILED)
    def fail(self):
        pass

    @transition(field=status, source=Status.RUNNING, target=Status.PAUSED)
    def pause(self):
        pass

    @transition(field=status, source=Status.PAUSED, target=Status.RESUMING)
    def resume(self):
        pass

    @transition(field=status, source=[Status.CREATED, Status.PENDING, Status.RUNNING, Status.PAUSED],
                target=Status.CANCELLED)
    def cancel(self):
        pass

    @transition(field=status, source=Status.FAILED, target=Status.RETRYING, conditions=[has_attempts_left])
    def retry(self):
        self.attempt_number += 1

    @transition(field=status, source=Status.RETRYING, target=Status.PENDING)
    def requeue(self):
        pass

    @transition(field=status, source=[Status.PAUSED, Status.FAILED], target=Status.CANCELLED)
    def void(self):
        """A stopped run (paused, or failed) is voided by an operator: it ends as cancelled."""

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_RUN_STATES or (
            self.status == Run.Status.FAILED and not self.has_attempts_left()
        )


TERMINAL_RUN_STATES = frozenset({Run.Status.COMPLETED, Run.Status.CANCELLED})
SETTLED_RUN_STATES = frozenset({Run.Status.COMPLETED, Run.Status.CANCELLED, Run.Status.FAILED})
ACTIVE_RUN_STATES = frozenset({Run.Status.PENDING, Run.Status.RUNNING, Run.Status.PAUSED, Run.Status.RESUMING,
                               Run.Status.RETRYING})


class RunAttempt(models.Model):
    """One attempt of a run: its own reservation, charges and refunds (kept after retries)."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    credits_reserved = models.BigIntegerField(default=0)
    credits_charged = models.BigIntegerField(default=0)
    credits_refunded = models.BigIntegerField(default=0)
    outcome = models.CharField(max_length=16, blank=True, default="")
    error_code = models.CharField(max_length=100, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    active_ms = models.BigIntegerField(default=0, help_text="time spent running before active_since (gated runs)")
    active_since = models.DateTimeField(null=True, blank=True, help_text="running since (gated runs)")
    hard_cap_escalated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "number"]
        constraints = [
            models.UniqueConstraint(fields=["run", "number"], name="run_attempt_unique_number"),
            models.CheckConstraint(condition=models.Q(credits_reserved__gte=models.F("credits_charged")),
                                   name="attempt_reserved_covers_charged"),
            models.CheckConstraint(condition=models.Q(credits_charged__gte=0), name="attempt_charged_not_negative"),
        ]

    def __str__(self) -> str:
        return f"run {self.run_id} attempt {self.number}"


class NodeStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    RUNNING = "running", "Running"
    PAUSED = "paused", "Paused"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed"
    SKIPPED = "skipped", "Skipped"
    CANCELLED = "cancelled", "Cancelled"


LIVE_NODE_STATES = frozenset({NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.PAUSED})
DONE_NODE_STATES = frozenset({NodeStatus.COMPLETED, NodeStatus.FAILED, NodeStatus.SKIPPED, NodeStatus.CANCELLED})


class HierarchyNode(ConcurrentTransitionMixin, models.Model):
    """Status machine shared by agents, tasks and steps."""

    status = FSMField(max_length=16, choices=NodeStatus.choices, default=NodeStatus.PENDING, protected=True,
                      db_index=True)
    name = models.CharField(max_length=200)
    sequence = models.PositiveIntegerField()
    last_error_code = models.CharField(max_length=100, blank=True, default="")
    last_error = models.TextField(blank=True, default="")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        abstract = True

    @transition(field=status, source=NodeStatus.PENDING, target=NodeStatus.RUNNING)
    def begin(self):
        pass

    @transition(field=status, source=[NodeStatus.PENDING, NodeStatus.RUNNING], target=NodeStatus.PAUSED)
    def pause(self):
        pass

    @transition(field=status, source=NodeStatus.PAUSED, target=NodeStatus.PENDING)
    def unpause(self):
        pass

    @transition(field=status, source=[NodeStatus.RUNNING, NodeStatus.PAUSED], target=NodeStatus.COMPLETED)
    def complete(self):
        pass

    @transition(field=status, source=[NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.PAUSED],
                target=NodeStatus.FAILED)
    def fail(self):
        pass

    @transition(field=status, source=[NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.PAUSED],
                target=NodeStatus.SKIPPED)
    def skip(self):
        pass

    @transition(field=status, source=[NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.PAUSED],
                target=NodeStatus.CANCELLED)
    def cancel(self):
        pass

    @transition(field=status, source=[NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.PAUSED,
                                      NodeStatus.COMPLETED, NodeStatus.FAILED, NodeStatus.SKIPPED,
                                      NodeStatus.CANCELLED],
                target=NodeStatus.PENDING)
    def reset(self):
        """Back to pending for a retry of the enclosing level (history stays in attempts)."""
        self.finished_at = None


class Agent(HierarchyNode):
    """An agent of one run attempt: a set of tasks ordered by its ``parallelism_mode``."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="agents")
    attempt_number = models.PositiveIntegerField()
    failure_mode = models.CharField(max_length=16, choices=FailureMode.choices, default=FailureMode.FAIL_FAST)
    parallelism_mode = models.CharField(max_length=16, choices=ParallelismMode.choices,
                                        default=ParallelismMode.SEQUENTIAL)
    retry_count = models.PositiveSmallIntegerField(default=0)

    class Meta:
        ordering = ["run_id", "attempt_number", "sequence"]
        constraints = [
            models.UniqueConstraint(fields=["run", "attempt_number", "name"], name="agent_unique_name_per_attempt"),
        ]

    def __str__(self) -> str:
        return f"agent {self.name} of run {self.run_id}"


class Task(HierarchyNode):
    """A task of an agent: steps ordered by its ``parallelism_mode``; ``depends_on`` in a DAG."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="tasks")
    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="tasks")
    failure_mode = models.CharField(max_length=16, choices=FailureMode.choices, default=FailureMode.FAIL_FAST)
    parallelism_mode = models.CharField(max_length=16, choices=ParallelismMode.choices,
                                        default=ParallelismMode.SEQUENTIAL)
    depends_on = models.JSONField(default=list, blank=True)
    retry_count = models.PositiveSmallIntegerField(default=0)

    class Meta:
        ordering = ["agent_id", "sequence"]
        constraints = [models.UniqueConstraint(fields=["agent", "name"], name="task_unique_name_per_agent")]

    def __str__(self) -> str:
        return f"task {self.name} of agent {self.agent_id}"


class Step(HierarchyNode):
    """One tool invocation (or a gate). Each execution is a ``StepAttempt``."""

    class Kind(models.TextChoices):
        TOOL = "tool", "Tool"
        CHECK = "check", "Check"
        APPROVAL = "approval", "Approval"

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="steps")
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="steps")
    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.TOOL)
    tool = models.CharField(max_length=100, blank=True, default="")
    args = models.JSONField(default=dict, blank=True)
    attempts = models.PositiveIntegerField(default=0, help_text="attempts made, across retries")
    tries_this_round = models.PositiveSmallIntegerField(default=0)
    max_tries = models.PositiveSmallIntegerField(default=MAX_RETRIES_PER_LEVEL)
    not_before = models.DateTimeField(null=True, blank=True)
    output = models.JSONField(null=True, blank=True)
    credits_charged = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["task_id", "sequence"]
        constraints = [models.UniqueConstraint(fields=["task", "name"], name="step_unique_name_per_task")]

    def __str__(self) -> str:
        return f"step {self.name} of task {self.task_id}"


class StepAttempt(models.Model):
    """One execution of a step; its idempotency key is unique, so a replay never runs twice."""

    class Outcome(models.TextChoices):
        RUNNING = "running", "Running"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"
        DISCARDED = "discarded", "Discarded"

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="step_attempts")
    step = models.ForeignKey(Step, on_delete=models.CASCADE, related_name="step_attempts")
    number = models.PositiveIntegerField()
    idempotency_key = models.CharField(max_length=200, unique=True)
    outcome = models.CharField(max_length=16, choices=Outcome.choices, default=Outcome.RUNNING)
    cost = models.BigIntegerField(default=0)
    retryable = models.BooleanField(null=True, blank=True)
    error_code = models.CharField(max_length=100, blank=True, default="")
    error = models.TextField(blank=True, default="")
    started_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["step_id", "number"]
        constraints = [models.UniqueConstraint(fields=["step", "number"], name="step_attempt_unique_number")]
        indexes = [models.Index(fields=["finished_at"], condition=models.Q(outcome="failed"),
                                name="step_attempt_failed_at")]

    def __str__(self) -> str:
        return self.idempotency_key


class Artifact(models.Model):
    """A file a run produced. Expires ``ORCHESTRATOR_ARTIFACT_TTL_DAYS`` after the run completes."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="artifacts")
    name = models.CharField(max_length=255)
    storage_key = models.CharField(max_length=512, unique=True)
    size_bytes = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run_id", "name"]
        constraints = [models.UniqueConstraint(fields=["run", "name"], name="artifact_unique_name_per_run")]

    def __str__(self) -> str:
        return f"{self.name} of run {self.run_id}"


class EscalationTicket(models.Model):
    """A run handed to a human (seed 001 §6.2): open → acknowledged → resolved."""

    class Status(models.TextChoices):
        OPEN = "open", "Open"
        ACKNOWLEDGED = "acknowledged", "Acknowledged"
        RESOLVED = "resolved", "Resolved"

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
            models.UniqueConstraint(fields=["run", "trigger"], condition=~models.Q(status="resolved"),
                                    name="escalation_one_unresolved_per_trigger"),
        ]
        permissions = [("manage_escalation", "Can acknowledge and resolve escalations")]

    def __str__(self) -> str:
        return f"escalation {self.pk} of run {self.run_id} ({self.trigger}, {self.status})"

    @transition(field=status, source=Status.OPEN, target=Status.ACKNOWLEDGED)
    def acknowledge(self):
        pass

    @transition(field=status, source=[Status.OPEN, Status.ACKNOWLEDGED], target=Status.RESOLVED)
    def resolve(self):
        pass


class ApprovalRequest(models.Model):
    """A sovereign gate waiting for a human: the run pauses until an approval names the gate
    and an approval reference that no other run or gate has used."""

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        APPROVED = "approved", "Approved"
        VOIDED = "voided", "Voided"

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


# --- gated pipelines (DESIGN §4, seed 002) -----------------------------------------------------

class PhaseRecord(models.Model):
    """A phase of a gated pipeline (one task of the plan) in one attempt: when it ran, its soft cap,
    how much running time it used (the attempt's running clock at its start and end) and its result."""

    class Result(models.TextChoices):
        RUNNING = "running", "Running"
        PASSED = "passed", "Passed"
        FAILED = "failed", "Failed"

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
        GATE = "gate", "Gate"
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
        PIN = "pin", "Pin"
        INVARIANT = "invariant", "Gate invariant"

    class Status(models.TextChoices):
        OPEN = "open", "Open"
        ACKNOWLEDGED = "acknowledged", "Acknowledged"

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
