"""A run and its attempts: the run's state machine, its state groups and the modes a plan chooses."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models.functions import Coalesce
from django_fsm import FSMField, transition

from core.fsm import ConcurrentTransitions, StateMove
from core.models import Organization, Project


class FailureMode(models.TextChoices):
    FAIL_FAST = "fail-fast", "Fail fast"
    CONTINUE = "continue"
    RETRY = "retry"


class ParallelismMode(models.TextChoices):
    SEQUENTIAL = "sequential"
    PARALLEL = "parallel"
    DAG = "dag", "DAG"


MAX_RETRIES_PER_LEVEL = 3


class RunQuerySet(models.QuerySet):
    def alive(self):
        return self.filter(deleted_at__isnull=True)


class Run(ConcurrentTransitions, models.Model):
    """A top-level execution: a plan of agents, tasks and steps, billed against a reservation.

    Guarantees (kept by the services): credits ``reserved >= charged >= 0`` at every moment and
    ``charged + refunded = reserved`` in every terminal state; exactly one winner when two
    transitions race; ``failed`` is terminal once ``attempt_number == max_attempts``.
    """

    class Status(models.TextChoices):
        CREATED = "created"
        PENDING = "pending"
        RUNNING = "running"
        PAUSED = "paused"
        RESUMING = "resuming"
        COMPLETED = "completed"
        FAILED = "failed"
        CANCELLED = "cancelled"
        RETRYING = "retrying"

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
            # The API's runs of an organization (not deleted), newest first, and their bounded count:
            # an index-only range, not a scan of the table under a limit.
            models.Index(fields=["organization", "id"], name="run_alive_org_id_idx",
                         condition=models.Q(deleted_at__isnull=True)),
            # The run list (newest first) filtered by status, project or error code: an index seek.
            models.Index(fields=["status", "id"], name="run_status_id_idx"),
            models.Index(fields=["project", "id"], name="run_project_id_idx"),
            models.Index(fields=["last_error_code", "id"], name="run_error_code_id_idx"),
            # Live runs newest first: the "stuck" list walks only these.
            models.Index(fields=["id"], name="run_live_id_idx", condition=models.Q(
                status__in=["pending", "running", "paused", "resuming", "retrying"])),
            # Running runs by start and by last sign of life (the heartbeat, or the status change of a
            # run that never beat): the "stuck" parts of the dashboard and its bounded counts read
            # only the running runs past a timeout (runs.selectors.run_stuck_parts).
            models.Index(fields=["started_at"], name="run_running_started_idx",
                         condition=models.Q(status="running")),
            # (The times under the expression are included too: PostgreSQL reads an expression index
            # without the table only when it holds the columns the expression is made of.)
            models.Index(Coalesce("last_heartbeat", "status_changed_at"), name="run_running_silent_idx",
                         include=["id", "started_at", "last_heartbeat", "status_changed_at"],
                         condition=models.Q(status="running")),
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
        # the runbook permissions (start_run, cancel_run ...) are declared by the runbooks (runs.runbooks)

    def __str__(self) -> str:
        return f"run {self.pk} {self.name!r} ({self.status})"

    # --- transitions: set fields on self only ---------------------------------------------
    def has_attempts_left(self) -> bool:
        return self.attempt_number < self.max_attempts

    start = StateMove(status, source=Status.CREATED, target=Status.PENDING)
    mark_running = StateMove(status, source=[Status.PENDING, Status.RESUMING], target=Status.RUNNING)
    complete = StateMove(status, source=Status.RUNNING, target=Status.COMPLETED)
    fail = StateMove(status, source=[Status.PENDING, Status.RUNNING, Status.RESUMING, Status.RETRYING],
                     target=Status.FAILED)
    pause = StateMove(status, source=Status.RUNNING, target=Status.PAUSED)
    resume = StateMove(status, source=Status.PAUSED, target=Status.RESUMING)
    cancel = StateMove(status, source=[Status.CREATED, Status.PENDING, Status.RUNNING, Status.PAUSED],
                       target=Status.CANCELLED)

    @transition(field=status, source=Status.FAILED, target=Status.RETRYING, conditions=[has_attempts_left])
    def retry(self):
        self.attempt_number += 1

    requeue = StateMove(status, source=Status.RETRYING, target=Status.PENDING)

    # A stopped run (paused, or failed) is voided by an operator: it ends as cancelled.
    void = StateMove(status, source=[Status.PAUSED, Status.FAILED], target=Status.CANCELLED)

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_RUN_STATES or (
            self.status == Run.Status.FAILED and not self.has_attempts_left()
        )


# The run's state groups, named once (ordered tuples where a URL or a list shows them).
TERMINAL_RUN_STATES = frozenset({Run.Status.COMPLETED, Run.Status.CANCELLED})
SETTLED_RUN_STATES = frozenset({Run.Status.COMPLETED, Run.Status.CANCELLED, Run.Status.FAILED})
# Between start and an outcome, and not paused: a worker owes it progress.
IN_FLIGHT_RUN_STATES = (Run.Status.PENDING, Run.Status.RUNNING, Run.Status.RESUMING, Run.Status.RETRYING)
ACTIVE_RUN_STATES = frozenset({*IN_FLIGHT_RUN_STATES, Run.Status.PAUSED})
# Not ended: created or active (the dashboard's "live in all").
LIVE_RUN_STATES = (Run.Status.CREATED, Run.Status.PENDING, Run.Status.RUNNING, Run.Status.PAUSED,
                   Run.Status.RESUMING, Run.Status.RETRYING)
# Before the current attempt's agents exist.
NOT_STARTED_RUN_STATES = frozenset({Run.Status.CREATED, Run.Status.PENDING, Run.Status.RETRYING})


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
