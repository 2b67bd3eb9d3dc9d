"""The job table: the source of truth for queue order, leases and outcomes.

django-q2 only carries "a job may be ready" messages; workers claim the best eligible row.
The state field carries exactly the Gate4 contract (seed 000, AG-ORCH-01): eight states,
self-transitions allowed, terminal states immutable, every other move an explicit error.
"""

from __future__ import annotations

from django.db import models
from django_fsm import ConcurrentTransitionMixin, FSMField, transition

from core.models import Organization, Project


class JobState(models.TextChoices):
    RECEIVED = "received", "Received"
    QUEUED = "queued", "Queued"
    EXECUTING = "executing", "Executing"
    AWAITING_TOOL = "awaiting_tool", "Awaiting tool (retry wait)"
    AWAITING_USER_CONFIRMATION = "awaiting_user_confirmation", "Awaiting user confirmation"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


S = JobState
# Seed 000's deterministic transition matrix, named once.
TRANSITIONS: dict[str, frozenset[str]] = {
    S.RECEIVED: frozenset({S.RECEIVED, S.QUEUED, S.FAILED, S.CANCELLED}),
    S.QUEUED: frozenset({S.QUEUED, S.EXECUTING, S.FAILED, S.CANCELLED}),
    S.EXECUTING: frozenset({S.EXECUTING, S.AWAITING_TOOL, S.AWAITING_USER_CONFIRMATION, S.COMPLETED, S.FAILED,
                            S.CANCELLED}),
    S.AWAITING_TOOL: frozenset({S.AWAITING_TOOL, S.EXECUTING, S.FAILED, S.CANCELLED}),
    S.AWAITING_USER_CONFIRMATION: frozenset({S.AWAITING_USER_CONFIRMATION, S.EXECUTING, S.FAILED, S.CANCELLED}),
    S.COMPLETED: frozenset({S.COMPLETED}),
    S.FAILED: frozenset({S.FAILED}),
    S.CANCELLED: frozenset({S.CANCELLED}),
}
TERMINAL_JOB_STATES = frozenset({S.COMPLETED, S.FAILED, S.CANCELLED})
WAITING_JOB_STATES = frozenset({S.QUEUED, S.AWAITING_TOOL})  # claimable once not_before has passed
ACTIVE_JOB_STATES = frozenset(set(JobState.values) - set(TERMINAL_JOB_STATES))


def _sources(target: str) -> list[str]:
    return sorted(state for state, targets in TRANSITIONS.items() if target in targets)


class JobReason(models.TextChoices):
    """Reason codes recorded with transitions (every terminal failure carries one)."""

    NONE = "", "—"
    COMPLETED = "completed", "Completed"
    FALLBACK = "deadline_fallback", "Deadline passed: fallback result"
    CANCELLED = "cancelled", "Cancelled"
    RETRY_SCHEDULED = "retry_scheduled", "Retry scheduled"
    LEASE_EXPIRED = "lease_expired", "Worker lost: lease expired"
    MAX_ATTEMPTS = "max_attempts_exhausted", "Attempts exhausted"
    MAX_FAILURES = "max_failures_exhausted", "Failures exhausted"
    FATAL = "fatal_error", "Fatal error"
    TIMEOUT = "timeout", "Timed out"
    RECOVERY_EXHAUSTED = "recovery_exhausted", "Recovery exhausted"
    INVALID_PAYLOAD = "invalid_payload", "Invalid or unknown payload"
    INTERRUPT_TIMEOUT = "interrupt_timeout", "Did not stop within the graceful window"
    SHUTDOWN_TIMEOUT = "shutdown_timeout", "Worker shut down mid-job"


class PriorityClass(models.TextChoices):
    INTERACTIVE = "interactive", "Interactive"
    BACKGROUND = "background", "Background"


class Job(ConcurrentTransitionMixin, models.Model):
    """A unit of queued work of a registered type, owned by a project.

    At most one job per lane and at most ``GLOBAL_CONCURRENCY`` jobs are executing at any
    moment: both are unique constraints over executing rows, not read-then-write checks.
    Active jobs with the same ``dedupe_key`` cannot coexist (another unique constraint).
    """

    id = models.BigAutoField(primary_key=True)
    type = models.CharField(max_length=100, db_index=True)
    version = models.PositiveIntegerField(default=1)
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="jobs")
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="jobs")
    state = FSMField(max_length=32, choices=JobState.choices, default=JobState.RECEIVED, protected=True)
    reason = models.CharField(max_length=40, choices=JobReason.choices, blank=True, default="")
    priority = models.IntegerField(default=100, help_text="lower runs first")
    priority_class = models.CharField(max_length=16, choices=PriorityClass.choices, default=PriorityClass.BACKGROUND)
    class_rank = models.PositiveSmallIntegerField(default=1, help_text="0 interactive, 1 background")
    lane = models.CharField(max_length=200, blank=True, default="")
    dedupe_key = models.CharField(max_length=300, blank=True, default="")
    active_dedupe_key = models.CharField(max_length=300, null=True, blank=True,
                                         help_text="set while active; unique, so duplicates cannot be enqueued")
    payload = models.JSONField(default=dict)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    progress = models.JSONField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=2)
    failures = models.PositiveIntegerField(default=0)
    max_failures = models.PositiveIntegerField(default=2)
    not_before = models.DateTimeField(null=True, blank=True)
    slot = models.PositiveSmallIntegerField(null=True, blank=True, help_text="concurrency slot while executing")
    worker = models.CharField(max_length=200, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    timeout_s = models.FloatField(null=True, blank=True)
    deadline_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancel_reason = models.TextField(blank=True, default="")
    source_session_id = models.CharField(max_length=200, blank=True, default="")
    thread_id = models.CharField(max_length=200, blank=True, default="")
    run_id = models.BigIntegerField(null=True, blank=True, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    queued_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["priority", "class_rank", "id"], name="job_claim_order_idx",
                         condition=models.Q(state__in=["queued", "awaiting_tool"])),
            models.Index(fields=["project", "state"], name="job_project_state_idx"),
            models.Index(fields=["state", "lease_expires_at"], name="job_state_lease_idx"),
            models.Index(fields=["lane", "state"], name="job_lane_state_idx"),
        ]
        constraints = [
            models.UniqueConstraint(fields=["lane"], condition=models.Q(state="executing") & ~models.Q(lane=""),
                                    name="job_one_executing_per_lane"),
            models.UniqueConstraint(fields=["slot"], condition=models.Q(state="executing"),
                                    name="job_one_executing_per_slot"),
            models.UniqueConstraint(fields=["active_dedupe_key"], name="job_unique_active_dedupe_key"),
            models.CheckConstraint(condition=models.Q(state="executing") | models.Q(slot__isnull=True),
                                   name="job_slot_only_while_executing"),
        ]
        permissions = [("requeue_job", "Can requeue a stuck job"), ("fail_job", "Can fail a stuck job"),
                       ("cancel_job", "Can cancel a job")]

    def __str__(self) -> str:
        return f"job {self.pk} {self.type} ({self.state})"

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_JOB_STATES

    # One transition per target state; sources come from the matrix above.
    @transition(field=state, source=_sources(S.RECEIVED), target=S.RECEIVED)
    def to_received(self):
        pass

    @transition(field=state, source=_sources(S.QUEUED), target=S.QUEUED)
    def to_queued(self):
        pass

    @transition(field=state, source=_sources(S.EXECUTING), target=S.EXECUTING)
    def to_executing(self):
        pass

    @transition(field=state, source=_sources(S.AWAITING_TOOL), target=S.AWAITING_TOOL)
    def to_awaiting_tool(self):
        pass

    @transition(field=state, source=_sources(S.AWAITING_USER_CONFIRMATION), target=S.AWAITING_USER_CONFIRMATION)
    def to_awaiting_user_confirmation(self):
        pass

    @transition(field=state, source=_sources(S.COMPLETED), target=S.COMPLETED)
    def to_completed(self):
        pass

    @transition(field=state, source=_sources(S.FAILED), target=S.FAILED)
    def to_failed(self):
        pass

    @transition(field=state, source=_sources(S.CANCELLED), target=S.CANCELLED)
    def to_cancelled(self):
        pass


class JobLane(models.Model):
    """Per-lane fairness state: consecutive interactive jobs started (the aging guard)."""

    key = models.CharField(max_length=200, primary_key=True)
    interactive_streak = models.PositiveIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return self.key


class WorkerHeartbeat(models.Model):
    """A worker process seen alive (hostname:pid), refreshed every few seconds."""

    worker = models.CharField(max_length=200, primary_key=True)
    cluster = models.CharField(max_length=200, blank=True, default="")
    started_at = models.DateTimeField()
    last_seen = models.DateTimeField(db_index=True)
    current_job_id = models.BigIntegerField(null=True, blank=True)
    jobs_done = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return self.worker


class MaintenanceMark(models.Model):
    """When a periodic maintenance task (reaper, pump) last ran, so workers share one cadence."""

    name = models.CharField(max_length=64, primary_key=True)
    last_run = models.DateTimeField()
