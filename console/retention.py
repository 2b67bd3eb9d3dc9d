"""Retention: what the prune deletes, in batches, so every table stays bounded under load.

``retention_prune`` runs these steps in order (``python manage.py prune``, and a django-q2
schedule every 10 minutes):

=================  ===========================================================================
idempotency        ``Idempotency-Key`` records past their expiry
artifacts          artifact files past ``expires_at``: deleted from storage, the row marked
                   ``deleted_at`` (reading an artifact pushes its expiry forward first, seed
                   001 §8.4, so a download in flight is never pruned under it)
jobs               terminal jobs finished longer ago than their project's retention (what they
                   counted moves to the metrics base in the deleting transaction: the
                   counters derived from the job table never go down)
events             events older than their project's retention
rate_limits        request counters of windows that ended
workers            heartbeats of worker processes not seen within the default retention
task_results       django-q2 task results older than the default retention
metric_samples     pending metric samples, folded into their totals (not lost)
=================  ===========================================================================

Retention is ``Project.retention_days``, or ``ORCHESTRATOR_RETENTION_DAYS``, and never less than
``MIN_AGE`` (an hour). Jobs and events of runs that are still live (not completed, cancelled or
failed) are kept whatever their age, so a live run's history can always be replayed. Ledger
entries and audit records are never deleted, by any step. Events are only ever deleted far
behind the relays: a relay delivers an event within ``GAP_WAIT_S`` of its commit, relays keep
their cursor in memory only, so the guard is that age (and, when a relay runs in the pruning
process, its cursor).

Each step deletes by primary key in batches of ``ORCHESTRATOR_RETENTION_BATCH`` rows (oldest
first, one short transaction per batch), so a prune never holds long locks; a time budget
bounds one scheduled run, and the next run goes on where it stopped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

from django.conf import settings
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from django_q.models import Task

from core.errors import NotFound, ValidationFailed
from core.metrics import metrics_compact
from core.models import Event, IdempotencyRecord, MetricDelta, Project, RateLimitCounter
from core.ratelimit import rate_limit_longest_period_s
from core.relay import relay_status
from core.services import audit_record
from jobs.models import TERMINAL_JOB_STATES, Job, WorkerHeartbeat
from runs.artifacts import artifact_expire
from runs.models import SETTLED_RUN_STATES, Artifact, Run

logger = logging.getLogger("orchestrator.retention")

# Whatever a project's retention, jobs and events younger than this are kept: a client waiting
# for a job's result, or a relay a little behind, still finds the rows.
MIN_AGE = timedelta(hours=1)


# --- a project's retention -----------------------------------------------------------------------

def project_retention_set(*, project_id: int, days: int | None, actor=None, reason: str = "") -> Project:
    """Set how many days a project's terminal jobs and events are kept (None: the default),
    with an audit record of the change."""

    if days is not None and (isinstance(days, bool) or not isinstance(days, int) or not 0 <= days <= 36_500):
        raise ValidationFailed("invalid retention", errors={"days": ["a whole number of days from 0 to 36500"]})
    with transaction.atomic():
        project = Project.objects.select_for_update().filter(pk=project_id).first()
        if project is None:
            raise NotFound(f"project {project_id} does not exist")
        before = project.retention_days
        if before != days:
            project.retention_days = days
            project.save(update_fields=["retention_days"])
            audit_record(actor=actor, action="project_retention_set", target_type="project", target_id=project.pk,
                         organization_id=project.organization_id, reason=reason,
                         before={"retention_days": before}, after={"retention_days": days})
        return project


# --- the steps ---------------------------------------------------------------------------------

@dataclass
class StepResult:
    name: str
    rule: str
    matched: int = 0
    done: int = 0
    failed: int = 0
    finished: bool = True


@dataclass
class Budget:
    """Rows per batch, and when to stop (None: when everything is done)."""

    batch: int
    deadline: float | None = None
    advance: Callable[[int], None] = field(default=lambda n: None)

    def spent(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


def _default_cutoff(now):
    return now - timedelta(days=settings.ORCHESTRATOR_RETENTION_DAYS)


def _project_cutoffs(now, project_field: str) -> list[tuple[Q, object]]:
    """``(filter, cutoff)`` pairs covering every row: projects with their own retention, then
    the rest (including rows without a project) with the default; never later than ``MIN_AGE`` ago."""
    latest = now - MIN_AGE
    custom: dict[int, list[int]] = {}
    for project_id, days in Project.objects.filter(retention_days__isnull=False).values_list("id", "retention_days"):
        custom.setdefault(days, []).append(project_id)
    pairs = [(Q(**{f"{project_field}__in": ids}), min(latest, now - timedelta(days=days)))
             for days, ids in sorted(custom.items())]
    with_custom = [project_id for ids in custom.values() for project_id in ids]
    rest = Q(**{f"{project_field}__isnull": True}) | ~Q(**{f"{project_field}__in": with_custom})
    pairs.append((rest, min(latest, _default_cutoff(now))))
    return pairs


def _live_run_ids():
    return Run.objects.exclude(status__in=list(SETTLED_RUN_STATES)).values("id")


def _expired_jobs(now) -> QuerySet:
    by_project = Q()
    for project_filter, cutoff in _project_cutoffs(now, "project_id"):
        by_project |= project_filter & Q(completed_at__lt=cutoff)
    return (Job.objects.filter(state__in=list(TERMINAL_JOB_STATES)).filter(by_project)
            .exclude(run_id__in=_live_run_ids()))


def _expired_events(now) -> QuerySet:
    by_project = Q()
    for project_filter, cutoff in _project_cutoffs(now, "project_id"):
        by_project |= project_filter & Q(created_at__lt=cutoff)
    queryset = Event.objects.filter(by_project).exclude(run_id__in=_live_run_ids())

    relay = relay_status()  # a relay in this process: never delete what it has not delivered
    if relay is not None:
        queryset = queryset.filter(id__lte=relay["cursor"])
    return queryset


def _delete_in_batches(queryset: QuerySet, result: StepResult, budget: Budget) -> None:
    """Delete ``queryset``'s rows oldest first, one batch per transaction, within the budget."""
    model = queryset.model
    while True:
        if budget.spent():
            result.finished = False
            return
        ids = list(queryset.order_by("pk").values_list("pk", flat=True)[:budget.batch])
        if not ids:
            return
        with transaction.atomic():
            model.objects.filter(pk__in=ids).delete()
        result.done += len(ids)
        budget.advance(len(ids))
        if len(ids) < budget.batch:
            return


class Step:
    name = ""
    rule = ""

    def queryset(self, now) -> QuerySet:
        raise NotImplementedError

    def count(self, now) -> int:
        return self.queryset(now).count()

    def run(self, now, result: StepResult, budget: Budget) -> None:
        _delete_in_batches(self.queryset(now), result, budget)


class IdempotencyStep(Step):
    name = "idempotency"
    rule = "Idempotency-Key records past their expiry"

    def queryset(self, now):
        return IdempotencyRecord.objects.filter(expires_at__lte=now)


class ArtifactStep(Step):
    name = "artifacts"
    rule = "artifact files past their expiry: deleted from storage, marked deleted"

    def queryset(self, now):
        return Artifact.objects.filter(deleted_at__isnull=True, expires_at__lte=now)

    def run(self, now, result, budget):
        after = 0
        while True:
            if budget.spent():
                result.finished = False
                return
            ids = list(self.queryset(now).filter(pk__gt=after).order_by("pk").values_list("pk", flat=True)[:budget.batch])
            if not ids:
                return
            for artifact_id in ids:
                try:
                    if artifact_expire(artifact_id=artifact_id, now=now):
                        result.done += 1
                except Exception:  # storage refused: keep the row as it is, retry on the next prune
                    logger.exception("could not delete the file of artifact %s", artifact_id)
                    result.failed += 1
                budget.advance(1)
            after = ids[-1]


class JobStep(Step):
    name = "jobs"
    rule = "terminal jobs finished before their project's retention (not of live runs)"

    def queryset(self, now):
        return _expired_jobs(now)


class EventStep(Step):
    name = "events"
    rule = "events older than their project's retention (not of live runs)"

    def queryset(self, now):
        return _expired_events(now)


class RateLimitStep(Step):
    name = "rate_limits"
    rule = "request counters of windows that ended"

    def queryset(self, now):

        # A window reaches back its period and one bucket (a tenth of it) more.
        kept_s = max(rate_limit_longest_period_s() * 11 // 10 + 1, 60)
        return RateLimitCounter.objects.filter(window_start__lt=now - timedelta(seconds=kept_s))


class WorkerStep(Step):
    name = "workers"
    rule = "heartbeats of worker processes not seen within the default retention"

    def queryset(self, now):
        return WorkerHeartbeat.objects.filter(last_seen__lt=_default_cutoff(now))


class TaskResultStep(Step):
    name = "task_results"
    rule = "django-q2 task results older than the default retention"

    def queryset(self, now):
        return Task.objects.filter(stopped__lt=_default_cutoff(now))


class MetricSampleStep(Step):
    name = "metric_samples"
    rule = "pending metric samples folded into their totals"

    def queryset(self, now):

        return MetricDelta.objects.all()

    def run(self, now, result, budget):

        while True:
            if budget.spent():
                result.finished = False
                return
            folded = metrics_compact(batch=budget.batch * 10, max_batches=1)
            result.done += folded
            budget.advance(folded)
            if folded == 0:
                return


STEPS: tuple[Step, ...] = (IdempotencyStep(), ArtifactStep(), JobStep(), EventStep(), RateLimitStep(), WorkerStep(),
                           TaskResultStep(), MetricSampleStep())
STEP_NAMES = tuple(step.name for step in STEPS)


def retention_prune(*, dry_run: bool = False, only: list[str] | None = None, now=None, batch: int | None = None,
                    max_seconds: float | None = None,
                    on_step: Callable[[str, int], Callable[[int], None]] | None = None) -> list[StepResult]:
    """Run the retention steps (or count what they would delete, with ``dry_run``).

    ``on_step(name, matched)`` may return an ``advance(n)`` callback for progress display.
    ``max_seconds`` bounds the whole prune; a step cut short reports ``finished=False``.
    """
    now = now or timezone.now()
    batch = max(1, batch or settings.ORCHESTRATOR_RETENTION_BATCH)
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    unknown = sorted(set(only or ()) - set(STEP_NAMES))
    if unknown:
        raise ValueError(f"unknown retention step(s) {', '.join(unknown)}; one of {', '.join(STEP_NAMES)}")
    results = []
    for step in STEPS:
        if only and step.name not in only:
            continue
        result = StepResult(step.name, step.rule, matched=step.count(now))
        results.append(result)
        if dry_run or not result.matched:
            continue
        advance = on_step(step.name, result.matched) if on_step else None
        budget = Budget(batch=batch, deadline=deadline, advance=advance or (lambda n: None))
        step.run(now, result, budget)
    return results


def retention_prune_scheduled() -> dict[str, int]:
    """The django-q2 schedule's entry point: one bounded prune (``ORCHESTRATOR_RETENTION_MAX_S``)."""
    results = retention_prune(max_seconds=settings.ORCHESTRATOR_RETENTION_MAX_S)
    summary = {result.name: result.done for result in results}
    unfinished = [result.name for result in results if not result.finished]
    if any(summary.values()) or unfinished:
        logger.info("prune: %s", ", ".join(f"{name} {count}" for name, count in summary.items()),
                    extra={"fields": {"event": "prune", **summary, "unfinished": unfinished}})
    return summary
