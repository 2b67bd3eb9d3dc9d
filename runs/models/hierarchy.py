"""A run's hierarchy: agents, tasks and steps (one status machine, ``NodeStatus``) and step attempts."""

from __future__ import annotations

from django.db import models
from django_fsm import FSMField, transition

from core.fsm import ConcurrentTransitions, StateMove
from runs.models.run import MAX_RETRIES_PER_LEVEL, FailureMode, ParallelismMode, Run


class NodeStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    SKIPPED = "skipped"
    CANCELLED = "cancelled"


LIVE_NODE_STATES = frozenset({NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.PAUSED})
DONE_NODE_STATES = frozenset({NodeStatus.COMPLETED, NodeStatus.FAILED, NodeStatus.SKIPPED, NodeStatus.CANCELLED})


class HierarchyNode(ConcurrentTransitions, models.Model):
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

    # The fields a node's moves change (what ``_node_move`` writes); the rest is its plan, written
    # once when the node is created.
    MOVING_FIELDS: tuple[str, ...] = ("status", "last_error_code", "last_error", "started_at", "finished_at")

    begin = StateMove(status, source=NodeStatus.PENDING, target=NodeStatus.RUNNING)
    pause = StateMove(status, source=[NodeStatus.PENDING, NodeStatus.RUNNING], target=NodeStatus.PAUSED)
    unpause = StateMove(status, source=NodeStatus.PAUSED, target=NodeStatus.PENDING)
    complete = StateMove(status, source=[NodeStatus.RUNNING, NodeStatus.PAUSED], target=NodeStatus.COMPLETED)
    fail = StateMove(status, source=[NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.PAUSED],
                     target=NodeStatus.FAILED)
    skip = StateMove(status, source=[NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.PAUSED],
                     target=NodeStatus.SKIPPED)
    cancel = StateMove(status, source=[NodeStatus.PENDING, NodeStatus.RUNNING, NodeStatus.PAUSED],
                       target=NodeStatus.CANCELLED)

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

    MOVING_FIELDS = (*HierarchyNode.MOVING_FIELDS, "retry_count")

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

    MOVING_FIELDS = (*HierarchyNode.MOVING_FIELDS, "retry_count")

    class Meta:
        ordering = ["agent_id", "sequence"]
        constraints = [models.UniqueConstraint(fields=["agent", "name"], name="task_unique_name_per_agent")]

    def __str__(self) -> str:
        return f"task {self.name} of agent {self.agent_id}"


class Step(HierarchyNode):
    """One tool invocation (or a gate). Each execution is a ``StepAttempt``."""

    class Kind(models.TextChoices):
        TOOL = "tool"
        CHECK = "check"
        APPROVAL = "approval"

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

    MOVING_FIELDS = (*HierarchyNode.MOVING_FIELDS, "attempts", "tries_this_round", "not_before", "output",
                     "credits_charged")

    class Meta:
        ordering = ["task_id", "sequence"]
        constraints = [models.UniqueConstraint(fields=["task", "name"], name="step_unique_name_per_task")]

    def __str__(self) -> str:
        return f"step {self.name} of task {self.task_id}"


class StepAttempt(models.Model):
    """One execution of a step; its idempotency key is unique, so a replay never runs twice."""

    class Outcome(models.TextChoices):
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        DISCARDED = "discarded"

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
