"""Tenancy (organizations, projects, memberships), the event outbox and the audit trail.

``jobs``, ``billing`` and ``runs`` all write events and audit records, so both live here,
below every domain app.
"""

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models


class Organization(models.Model):
    """A tenant. Owns a credit account (billing) and projects; users are its members."""

    name = models.CharField(max_length=200, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    members = models.ManyToManyField(
        settings.AUTH_USER_MODEL, through="Membership", related_name="organizations"
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    """A user's membership of an organization; API access and streams are limited to these."""

    class Role(models.TextChoices):
        OWNER = "owner"
        MEMBER = "member"

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["organization", "user"], name="membership_unique_user_per_org")
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.organization} ({self.role})"


class Project(models.Model):
    """A project of an organization; runs and jobs belong to a project."""

    organization = models.ForeignKey(Organization, on_delete=models.PROTECT, related_name="projects")
    name = models.CharField(max_length=200)
    retention_days = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="days terminal jobs and events of this project are kept (empty: ORCHESTRATOR_RETENTION_DAYS)")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["organization_id", "name"]
        constraints = [
            models.UniqueConstraint(fields=["organization", "name"], name="project_unique_name_per_org")
        ]

    def __str__(self) -> str:
        return f"{self.organization.name}/{self.name}"


class Event(models.Model):
    """An outbox row: one per state change, written in the transaction that made the change.

    Ids increase monotonically; the live relay pushes committed rows in id order, and clients
    reconcile with ``after=<id>``.
    """

    id = models.BigAutoField(primary_key=True)
    type = models.CharField(max_length=64)
    organization = models.ForeignKey(Organization, null=True, blank=True, on_delete=models.DO_NOTHING,
                                     db_constraint=False, related_name="+", db_index=False)
    project = models.ForeignKey(Project, null=True, blank=True, on_delete=models.DO_NOTHING,
                                db_constraint=False, related_name="+")
    run_id = models.BigIntegerField(null=True, blank=True)
    payload = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["id"]
        # Every state change writes an event, and each index costs that write one more entry: the
        # organization's lookups use ``event_org_id_idx``; ``type`` has no LIKE index (nothing
        # searches a prefix of it); events outside any run are not in the run index.
        indexes = [models.Index(fields=["organization", "id"], name="event_org_id_idx"),
                   models.Index(fields=["type"], name="event_type_idx"),
                   models.Index(fields=["run_id"], name="event_run_idx", condition=models.Q(run_id__isnull=False))]

    def __str__(self) -> str:
        return f"#{self.id} {self.type}"


class AuditRecord(models.Model):
    """Who did what to which object, when and why, with the state before and after."""

    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="+")
    actor_label = models.CharField(max_length=150, help_text="username, or 'system' for the engine")
    action = models.CharField(max_length=64, db_index=True)
    target_type = models.CharField(max_length=64)
    target_id = models.CharField(max_length=64)
    organization = models.ForeignKey(Organization, null=True, blank=True, on_delete=models.DO_NOTHING,
                                     db_constraint=False, related_name="+")
    run_id = models.BigIntegerField(null=True, blank=True, db_index=True)
    reason = models.TextField(blank=True)
    before = models.JSONField(default=dict, blank=True)
    after = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["target_type", "target_id"], name="audit_target_idx")]

    def __str__(self) -> str:
        return f"{self.actor_label} {self.action} {self.target_type}:{self.target_id}"


class IdempotencyRecord(models.Model):
    """One ``Idempotency-Key`` of one caller in one organization on one endpoint, and the answer it got.

    Keys are the caller's own (Stripe's rule): another user of the organization sending the same
    key has its own request processed, and never sees this answer.

    The row is inserted ``in_flight`` and committed before the request runs, so a concurrent
    duplicate finds it (``409 idempotency_key_in_use``); the response is stored byte for byte
    when the request ends (``done``) and replayed for the same key and body until
    ``expires_at``. ``lock_token`` names the request that owns an in-flight row: only that
    request may store or release it, and a row left in flight by a crashed request is taken
    over (a new token) once ``locked_at`` is older than the in-flight timeout.
    """

    class Status(models.TextChoices):
        IN_FLIGHT = "in_flight", "In flight"
        DONE = "done"

    id = models.BigAutoField(primary_key=True)
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="+")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.CASCADE, related_name="+",
                             help_text="the caller (empty only on rows written before keys were per caller)")
    key = models.CharField(max_length=255)
    endpoint = models.CharField(max_length=255, help_text="request path, e.g. /api/v1/runs/")
    request_hash = models.CharField(max_length=64, help_text="sha256 of method, query and canonical body")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.IN_FLIGHT)
    lock_token = models.CharField(max_length=32)
    locked_at = models.DateTimeField()
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    response_content_type = models.CharField(max_length=100, blank=True, default="")
    response_body = models.BinaryField(null=True, blank=True)
    created_at = models.DateTimeField()
    completed_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["organization", "user", "key", "endpoint"],
                                    name="idempotency_unique_caller_key"),
        ]

    def __str__(self) -> str:
        return f"{self.key} {self.endpoint} ({self.status})"


class MetricDelta(models.Model):
    """One increment of a metric, written in the transaction of the change it counts.

    Inserts only (no row is updated on the write path, so no two transactions wait for each
    other); ``metrics_compact`` folds them into ``MetricTotal`` in batches. A histogram
    observation is one row whose ``labels`` carry its bucket (``le``) and whose ``total`` is
    the observed value.
    """

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=64)
    labels = models.CharField(max_length=512, help_text="canonical JSON of the label values")
    count = models.BigIntegerField(default=1)
    total = models.FloatField(default=0.0)

    def __str__(self) -> str:
        return f"{self.name}{self.labels} +{self.count}"


class MetricTotal(models.Model):
    """The folded value of one metric series: ``count`` (and ``total`` for histograms) so far."""

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=64)
    labels = models.CharField(max_length=512)
    count = models.BigIntegerField(default=0)
    total = models.FloatField(default=0.0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["name", "labels"], name="metric_total_unique_series")]

    def __str__(self) -> str:
        return f"{self.name}{self.labels} = {self.count}"


class RateLimitCounter(models.Model):
    """Admitted requests of one principal (``user:<id>``, ``ip:<address>`` ...) in one bucket
    (a tenth of its limit's period) of its sliding window (``core.ratelimit``).

    The row at the epoch is the key's anchor: its row lock makes the decisions on one key take
    turns, so a read of the buckets and the upsert of the current one are never interleaved with
    another's. Buckets that left every window are pruned.
    """

    id = models.BigAutoField(primary_key=True)
    key = models.CharField(max_length=200)
    window_start = models.DateTimeField(db_index=True)
    count = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["key", "window_start"], name="rate_limit_unique_window")]

    def __str__(self) -> str:
        return f"{self.key} @ {self.window_start:%H:%M:%S}: {self.count}"


class BulkOperation(models.Model):
    """A runbook applied to every object an admin filter selects (``core.bulk``), tracked.

    The objects are those the changelist shows for ``query`` (its query string) whose primary key
    is at most ``last_pk`` (the largest when the operation started), taken in id order, a batch at
    a time; ``cursor`` is the last id processed, so a redelivered processing job goes on where it
    stopped. Each object goes through the runbook's service, which writes its audit record.
    """

    class Status(models.TextChoices):
        RUNNING = "running"
        FINISHED = "finished"
        ABORTED = "aborted"

    id = models.BigAutoField(primary_key=True)
    runbook = models.CharField(max_length=200, help_text="the runbook's label: app_label.model.name")
    query = models.TextField(blank=True, default="", help_text="the admin changelist's query string")
    options = models.JSONField(default=dict, blank=True, encoder=DjangoJSONEncoder)
    reason = models.TextField()
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                              related_name="+")
    actor_label = models.CharField(max_length=150)
    total = models.PositiveIntegerField(default=0)
    done = models.PositiveIntegerField(default=0)
    skipped = models.PositiveIntegerField(default=0)
    refused = models.PositiveIntegerField(default=0)
    refusals = models.JSONField(default=list, blank=True, help_text="the first refusals: [{id, detail}]")
    cursor = models.BigIntegerField(default=0, help_text="the last id processed")
    last_pk = models.BigIntegerField(default=0, help_text="the largest id selected when it started")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.RUNNING)
    abort_requested_by = models.CharField(max_length=150, blank=True, default="")
    started_at = models.DateTimeField(auto_now_add=True, db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"bulk operation {self.pk}: {self.runbook} ({self.status})"

    @property
    def processed(self) -> int:
        return self.done + self.skipped + self.refused
