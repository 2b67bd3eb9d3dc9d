"""The job table: the source of truth for queue order, leases and outcomes.

django-q2 only carries "a job may be ready" messages; workers claim the best eligible row.
The state field carries exactly the Gate4 contract (seed 000, AG-ORCH-01): eight states,
self-transitions allowed, terminal states immutable, every other move an explicit error.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models, transaction
from django_fsm import FSMField

from core.fsm import ConcurrentTransitions, StateMove
from core.metrics import metrics_fold
from core.models import Organization, Project
from jobs.counters import TALLY_FIELDS, job_tally


class JobState(models.TextChoices):
    RECEIVED = "received"
    QUEUED = "queued"
    EXECUTING = "executing"
    AWAITING_TOOL = "awaiting_tool", "Awaiting tool (retry wait)"
    AWAITING_USER_CONFIRMATION = "awaiting_user_confirmation", "Awaiting user confirmation"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


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
# Not started yet: what the queue caps count as waiting, and where "why is this waiting?" has an answer.
NOT_STARTED_JOB_STATES = (S.RECEIVED, S.QUEUED, S.AWAITING_TOOL, S.AWAITING_USER_CONFIRMATION)
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
    INSUFFICIENT_CREDITS = "insufficient_credits", "The organization could not pay for it"


class PriorityClass(models.TextChoices):
    INTERACTIVE = "interactive"
    BACKGROUND = "background"


DELETE_CHUNK = 10_000


class JobQuerySet(models.QuerySet):
    def delete(self):
        """Delete the jobs and add what they counted (``jobs.counters``) to the metrics base in the
        same transaction: the counters derived from the job table never go down. The rows are
        locked first, so two deletes of the same jobs never add them twice."""
        if self.query.is_sliced:
            raise TypeError("Cannot use 'limit' or 'offset' with delete().")
        with transaction.atomic(using=self.db):
            rows = list(self.order_by().select_for_update().values_list("pk", "counted", *TALLY_FIELDS))
            if not rows:
                return 0, {}
            # A job the roll-up already counted (``counted``) is in the base already.
            metrics_fold(job_tally((row[2:] for row in rows if not row[1]), TERMINAL_JOB_STATES))
            ids = [row[0] for row in rows]
            deleted, by_model = 0, {}
            for start in range(0, len(ids), DELETE_CHUNK):
                count, counts = models.QuerySet(self.model, using=self.db).filter(
                    pk__in=ids[start:start + DELETE_CHUNK]).delete()
                deleted += count
                for label, n in counts.items():
                    by_model[label] = by_model.get(label, 0) + n
            return deleted, by_model

    delete.alters_data = True
    delete.queryset_only = True


class Job(ConcurrentTransitions, models.Model):
    """A unit of queued work of a registered type, owned by a project.

    At most one job per lane, at most ``GLOBAL_CONCURRENCY`` jobs in all and at most
    ``ORG_MAX_EXECUTING`` jobs of one organization are executing at any moment: all three are
    unique constraints over executing rows (lane, slot, organization and its slot), not
    read-then-write checks.
    Active jobs with the same ``dedupe_key`` cannot coexist (another unique constraint).
    """

    id = models.BigAutoField(primary_key=True)
    # No single-column indexes on ``type``, ``organization`` and ``project``: the composite indexes
    # below lead with them and serve every lookup, and each index costs every write of a job row
    # (a claim, a completion) one more index entry.
    type = models.CharField(max_length=100)
    version = models.PositiveIntegerField(default=1)
    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="jobs", db_index=False)
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="jobs", db_index=False)
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
    organization_slot = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="the organization's concurrency slot while executing")
    worker = models.CharField(max_length=200, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    timeout_s = models.FloatField(null=True, blank=True)
    deadline_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancel_reason = models.TextField(blank=True, default="")
    source_session_id = models.CharField(max_length=200, blank=True, default="")
    thread_id = models.CharField(max_length=200, blank=True, default="")
    run_id = models.BigIntegerField(null=True, blank=True)
    traceparent = models.CharField(max_length=55, blank=True, default="",
                                   help_text="W3C trace context of the span that enqueued it (tracing on)")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    queued_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    # Set once by the counters' roll-up (``jobs.metrics.job_counters_rollup``) when a terminal job's
    # counts move to the metrics base; never written by a save (see ``save``).
    counted = models.BooleanField(default=False, db_default=False, editable=False)

    objects = JobQuerySet.as_manager()

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["priority", "class_rank", "id"], name="job_claim_order_idx",
                         condition=models.Q(state__in=["queued", "awaiting_tool"])),
            models.Index(fields=["project", "state"], name="job_project_state_idx"),
            # The executing jobs' leases (the recovery of expired ones): a job row written in another
            # state (enqueued, completed) is not in it.
            models.Index(fields=["lease_expires_at"], name="job_executing_lease_idx",
                         condition=models.Q(state="executing")),
            # The jobs of a lane by state (the aging guard's waiting jobs of a lane); the jobs outside
            # any lane (most of a busy queue's) are not in it.
            models.Index(fields=["lane", "state"], name="job_lane_state_idx", condition=~models.Q(lane="")),
            models.Index(fields=["organization", "state"], name="job_organization_state_idx"),
            # The jobs not started yet, by organization and project: the caps' counts at every enqueue
            # read these rows only, however many jobs the project and the queue have finished.
            models.Index(fields=["organization", "project"], name="job_not_started_scope_idx",
                         condition=models.Q(state__in=["received", "queued", "awaiting_tool",
                                                       "awaiting_user_confirmation"])),
            # The job list (newest first) filtered by state, type or project: an index seek.
            models.Index(fields=["state", "id"], name="job_state_id_idx"),
            models.Index(fields=["type", "id"], name="job_type_id_idx"),
            models.Index(fields=["project", "id"], name="job_project_id_idx"),
            # Jobs whose counts are not in the metrics base yet: what a scrape derives its counters from.
            models.Index(fields=["id"], name="job_uncounted_idx", condition=models.Q(counted=False)),
            # The executing jobs of a run: the claim's probe of a run's busy state (``spread_runs``),
            # whatever the number of jobs the run has had.
            models.Index(fields=["run_id"], name="job_executing_run_idx", condition=models.Q(state="executing")),
            # A run's jobs; the jobs outside any run (most of a busy queue's) are not in it.
            models.Index(fields=["run_id"], name="job_run_idx", condition=models.Q(run_id__isnull=False)),
            # Active jobs with a deadline: the maintenance probe and the deadline sweep.
            models.Index(fields=["deadline_at"], name="job_active_deadline_idx",
                         condition=models.Q(deadline_at__isnull=False) & models.Q(
                             state__in=["received", "queued", "executing", "awaiting_tool",
                                        "awaiting_user_confirmation"])),
        ]
        constraints = [
            models.UniqueConstraint(fields=["lane"], condition=models.Q(state="executing") & ~models.Q(lane=""),
                                    name="job_one_executing_per_lane"),
            models.UniqueConstraint(fields=["slot"], condition=models.Q(state="executing"),
                                    name="job_one_executing_per_slot"),
            # Only the jobs that hold a key are in it (most hold none; NULLs never conflict anyway).
            models.UniqueConstraint(fields=["active_dedupe_key"], name="job_unique_active_dedupe_key",
                                    condition=models.Q(active_dedupe_key__isnull=False)),
            models.CheckConstraint(condition=models.Q(state="executing") | models.Q(slot__isnull=True),
                                   name="job_slot_only_while_executing"),
            models.UniqueConstraint(fields=["organization", "organization_slot"], condition=models.Q(state="executing"),
                                    name="job_one_executing_per_organization_slot"),
            models.CheckConstraint(condition=models.Q(state="executing") | models.Q(organization_slot__isnull=True),
                                   name="job_organization_slot_only_while_executing"),
        ]
        # requeue_job, fail_job and cancel_job are declared by the job runbooks (jobs.runbooks)

    def __str__(self) -> str:
        return f"job {self.pk} {self.type} ({self.state})"

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_JOB_STATES

    def save(self, *args, **kwargs):
        """A save of a stored job writes every field but ``counted`` (only the roll-up sets it, under
        the row lock: an instance read before the roll-up must not clear it)."""
        if not self._state.adding and self.pk is not None and kwargs.get("update_fields") is None \
                and not kwargs.get("force_insert"):
            kwargs["update_fields"] = [field.name for field in self._meta.concrete_fields
                                       if not field.primary_key and field.name != "counted"]
        return super().save(*args, **kwargs)

    def delete(self, using=None, keep_parents=False):
        """One job, deleted as ``JobQuerySet.delete`` does (its counts move to the metrics base)."""
        result = Job.objects.using(using or self._state.db).filter(pk=self.pk).delete()
        self.pk = None
        return result

    # One transition per target state (``job.to_queued()`` ...); sources come from the matrix above.
    to_received = StateMove(state, source=_sources(S.RECEIVED), target=S.RECEIVED)
    to_queued = StateMove(state, source=_sources(S.QUEUED), target=S.QUEUED)
    to_executing = StateMove(state, source=_sources(S.EXECUTING), target=S.EXECUTING)
    to_awaiting_tool = StateMove(state, source=_sources(S.AWAITING_TOOL), target=S.AWAITING_TOOL)
    to_awaiting_user_confirmation = StateMove(state, source=_sources(S.AWAITING_USER_CONFIRMATION),
                                              target=S.AWAITING_USER_CONFIRMATION)
    to_completed = StateMove(state, source=_sources(S.COMPLETED), target=S.COMPLETED)
    to_failed = StateMove(state, source=_sources(S.FAILED), target=S.FAILED)
    to_cancelled = StateMove(state, source=_sources(S.CANCELLED), target=S.CANCELLED)


def index_states(name: str) -> list[str]:
    """The states a partial index of the job table names in its condition (``state__in``), in its
    order. SQLite uses a partial index only for a query whose condition is written as the index's,
    the same terms in the same order: a query of those jobs names them so."""
    index = next(index for index in Job._meta.indexes if index.name == name)
    pending = list(index.condition.children)
    while pending:
        child = pending.pop(0)
        if isinstance(child, models.Q):
            pending.extend(child.children)
        elif child[0] == "state__in":
            return list(child[1])
    raise LookupError(f"index {name} names no states")


class JobLane(models.Model):
    """Per-lane fairness state: consecutive interactive jobs started (the aging guard)."""

    key = models.CharField(max_length=200, primary_key=True)
    interactive_streak = models.PositiveIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        indexes = [
            # The claim's aged jobs start from the lanes whose streak reached the burst (few).
            models.Index(fields=["interactive_streak"], name="job_lane_streak_idx"),
        ]

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


# --- execution command boundary ---------------------------------------------------------
# Seed 000 AG-EXE-01 and seed 004 "Worker Session Provisioning". Written only by
# ``jobs.commands`` (commands, the reference adapter) and ``jobs.sessions`` (worker sessions).


class CommandKind(models.TextChoices):
    CREATE_DEPLOYMENT = "create_deployment", "Create deployment"
    STOP_DEPLOYMENT = "stop_deployment", "Stop deployment"
    PLACE_ORDER = "place_order", "Place order"
    CANCEL_ORDER = "cancel_order", "Cancel order"
    INVOKE_TOOL = "invoke_tool", "Invoke tool"


class CommandStatus(models.TextChoices):
    RECORDED = "recorded", "Recorded (no result yet)"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class CommandRecord(models.Model):
    """One side-effecting command, recorded (and committed) before its adapter is called.

    ``(project, kind, idempotency_key)`` is unique: a replay with the same payload hash gets
    the recorded result without a second side effect, another payload is a conflict. A row
    still ``recorded`` was never finished (its worker died, or a retryable error): replaying it
    calls the adapter again with the same key. ``attempts`` counts those adapter calls.
    """

    id = models.BigAutoField(primary_key=True)
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="commands")
    kind = models.CharField(max_length=40, choices=CommandKind.choices)
    idempotency_key = models.CharField(max_length=200)
    payload_hash = models.CharField(max_length=64, help_text="sha256 of the canonical JSON of the arguments")
    args = models.JSONField(default=dict)
    status = models.CharField(max_length=16, choices=CommandStatus.choices, default=CommandStatus.RECORDED)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    error_code = models.CharField(max_length=64, blank=True, default="")
    attempts = models.PositiveIntegerField(default=0, help_text="adapter calls made for this command")
    actor_label = models.CharField(max_length=150, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(fields=["project", "kind", "idempotency_key"],
                                    name="command_unique_key_per_project_kind"),
        ]
        indexes = [models.Index(fields=["status", "created_at"], name="command_status_idx")]

    def __str__(self) -> str:
        return f"command {self.pk} {self.kind} {self.idempotency_key} ({self.status})"


class Deployment(models.Model):
    """A deployment made by the reference ``DatabaseAdapter`` (one per creating idempotency key)."""

    class Status(models.TextChoices):
        ACTIVE = "active"
        STOPPED = "stopped"

    id = models.BigAutoField(primary_key=True)
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="deployments")
    name = models.CharField(max_length=200)
    spec = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    idempotency_key = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(fields=["project", "idempotency_key"], name="deployment_unique_key_per_project"),
        ]

    def __str__(self) -> str:
        return f"deployment {self.pk} {self.name} ({self.status})"


class Order(models.Model):
    """An order placed by the reference ``DatabaseAdapter`` (one per placing idempotency key)."""

    class Side(models.TextChoices):
        BUY = "buy"
        SELL = "sell"

    class Status(models.TextChoices):
        OPEN = "open"
        CANCELLED = "cancelled"

    id = models.BigAutoField(primary_key=True)
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="orders")
    deployment = models.ForeignKey(Deployment, null=True, blank=True, on_delete=models.PROTECT, related_name="orders")
    symbol = models.CharField(max_length=64)
    side = models.CharField(max_length=8, choices=Side.choices)
    quantity = models.DecimalField(max_digits=28, decimal_places=10)
    price = models.DecimalField(max_digits=28, decimal_places=10, null=True, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.OPEN)
    idempotency_key = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(fields=["project", "idempotency_key"], name="order_unique_key_per_project"),
        ]

    def __str__(self) -> str:
        return f"order {self.pk} {self.side} {self.quantity} {self.symbol} ({self.status})"


class AdapterCall(models.Model):
    """One write call received by the reference ``DatabaseAdapter``, committed with its effect.

    Replays show up here as extra calls with the same key while the effect exists once.
    """

    id = models.BigAutoField(primary_key=True)
    project = models.ForeignKey(Project, on_delete=models.PROTECT, related_name="+")
    adapter = models.CharField(max_length=64)
    operation = models.CharField(max_length=40)
    idempotency_key = models.CharField(max_length=200, blank=True, default="")
    outcome = models.CharField(max_length=64, blank=True, default="", help_text="created, existing, ... or an error code")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["project", "operation", "idempotency_key"], name="adapter_call_key_idx")]

    def __str__(self) -> str:
        return f"{self.adapter}.{self.operation} {self.idempotency_key}"


class WorkerSessionStatus(models.TextChoices):
    PROVISIONING = "provisioning"
    READY = "ready"
    STALE = "stale"
    FAILED = "failed"


class WorkerSession(models.Model):
    """An agent's working context, keyed ``owner::agent`` (owner ``project:<id>`` or ``session:<id>``).

    Created lazily on the first job (the key is unique, so concurrent first jobs share one row),
    preflighted once per generation, bootstrapped once per bootstrap key, and reprovisioned
    (a new generation) at most once per job when stale. System-owned sessions are hidden from
    user listings and refuse user operations.
    """

    id = models.BigAutoField(primary_key=True)
    key = models.CharField(max_length=400, unique=True)
    owner = models.CharField(max_length=200)
    agent = models.CharField(max_length=190)
    project = models.ForeignKey(Project, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    system_owned = models.BooleanField(default=True)
    status = models.CharField(max_length=16, choices=WorkerSessionStatus.choices,
                              default=WorkerSessionStatus.PROVISIONING)
    generation = models.PositiveIntegerField(default=1)
    preflight_at = models.DateTimeField(null=True, blank=True)
    bootstrap_keys = models.JSONField(default=list, blank=True, help_text="bootstrap keys done in this generation")
    reprovision_count = models.PositiveIntegerField(default=0)
    last_used_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["key"]
        indexes = [models.Index(fields=["system_owned", "status"], name="worker_session_owned_idx")]

    def __str__(self) -> str:
        return f"{self.key} (gen {self.generation}, {self.status})"


class QueuePause(models.Model):
    """A paused queue: a project's jobs, or every job of one type (exactly one of the two).

    While the row exists the claim passes the queue's jobs over (they keep waiting, in order;
    enqueueing goes on) and its runs wait; deleting it (``queue_resume``) lets them be claimed
    again. One pause per project and per job type.
    """

    id = models.BigAutoField(primary_key=True)
    project = models.ForeignKey(Project, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    job_type = models.CharField(max_length=100, blank=True, default="")
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="+")
    actor_label = models.CharField(max_length=150)
    reason = models.TextField()
    since = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["since", "id"]
        constraints = [
            models.UniqueConstraint(fields=["project"], condition=models.Q(project__isnull=False),
                                    name="queue_pause_one_per_project"),
            models.UniqueConstraint(fields=["job_type"], condition=~models.Q(job_type=""),
                                    name="queue_pause_one_per_job_type"),
            models.CheckConstraint(condition=(models.Q(project__isnull=False) & models.Q(job_type=""))
                                   | (models.Q(project__isnull=True) & ~models.Q(job_type="")),
                                   name="queue_pause_project_or_job_type"),
        ]
        # pause_queue is declared by the queue runbooks (jobs.runbooks)

    def __str__(self) -> str:
        return f"{self.queue} paused by {self.actor_label}"

    @property
    def queue(self) -> str:
        return f"project {self.project_id}" if self.project_id else f"job type {self.job_type}"
