"""django-q2 entry points. Idempotent: they take nothing but "go look for work", or the id of
a bulk operation that keeps its own cursor."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from core.bulk import bulk_operation_as_dict, bulk_operation_process
from core.models import BulkOperation
from jobs import executor, services, wake, worker
from jobs.selectors import jobs_due_exist

logger = logging.getLogger("orchestrator.jobs")


# Jobs claimed per statement by this process: doubles after a batch of quick jobs, up to
# ``ORCHESTRATOR_QUEUE_CLAIM_BATCH``; back to one after a slow job, so a long job holds back
# as few claimed jobs as possible.
_batch = {"size": 1}
QUICK_JOB_S = 0.05


def drain(*args, **kwargs) -> int:
    """Claim and run eligible jobs, a batch per claim, until none is left or the message's budget
    is spent; then, when the budget ran out first, send the next wake message. The drain's first
    claim that comes back full (as many jobs as it asked for) wakes one more worker while jobs are
    due (``wake.enqueue_wake_count``). A claim that does not follow a full one is made only if jobs
    are due (``jobs_due_exist``: an index read, no lock): the claims that would find nothing (a
    message whose jobs another drain took, the claim after a drain's last batch) were half of all
    claims under a steady stream, each holding the claim lock that every claim waits for.

    The budget (``ORCHESTRATOR_QUEUE_DRAIN_MAX_JOBS`` jobs, ``..._DRAIN_MAX_S`` seconds) keeps
    one message short, so stopping a cluster waits for at most one budget plus one batch. On
    PostgreSQL a drain that found nothing may linger a moment for jobs enqueued meanwhile
    (``wake.linger``, ``ORCHESTRATOR_QUEUE_DRAIN_LINGER_MS``).
    """
    worker.ensure_started()
    me = worker.worker_id()
    deadline = time.monotonic() + settings.ORCHESTRATOR_QUEUE_DRAIN_MAX_S
    budget = settings.ORCHESTRATOR_QUEUE_DRAIN_MAX_JOBS
    done = 0
    fanned_out = full = False
    while done < budget and time.monotonic() < deadline:
        listening = wake.listen_mark()
        asked = min(_batch["size"], budget - done)
        # Unless the last claim came back full, a claim is likely to find nothing (another drain took
        # the jobs this message was sent for, or this one took them all): one read without the claim
        # lock tells, and a claim that would find nothing is not made.
        jobs = services.jobs_claim(worker=me, limit=asked) if full or jobs_due_exist(timezone.now()) else []
        full = len(jobs) == asked
        if not jobs:
            if wake.linger(listening, deadline):
                continue  # a job was enqueued meanwhile: claim it now
            return done
        if not fanned_out and full:
            # More may wait than this worker takes in one claim (an enqueue wakes a worker per batch):
            # while jobs are due, one more worker joins, and its drain does the same.
            fanned_out = True
            if jobs_due_exist(timezone.now()):
                wake.wake_workers(1, force=True)
        started = time.monotonic()
        executor.jobs_run_claimed(jobs, worker=me)
        quick = (time.monotonic() - started) / len(jobs) < QUICK_JOB_S
        _batch["size"] = min(2 * _batch["size"], max(1, settings.ORCHESTRATOR_QUEUE_CLAIM_BATCH)) if quick else 1
        done += len(jobs)
    wake.wake_workers(1, force=True)  # work may be left: the next message goes on with it
    return done


def maintenance(*args, **kwargs) -> dict:
    """The scheduled backstop of the workers' own maintenance (every minute); bulk operations whose
    message was lost (no progress for longer than django-q2's redelivery delay) are sent again."""
    stalled_since = timezone.now() - timedelta(seconds=settings.Q_CLUSTER["retry"])
    for operation_id in BulkOperation.objects.filter(status=BulkOperation.Status.RUNNING,
                                                     updated_at__lt=stalled_since).values_list("pk", flat=True):
        bulk_runbook_send(operation_id)
    return worker.maintain()


def bulk_runbook(operation_id: int, *args, **kwargs) -> dict:
    """The ``bulk_runbook`` task: process a bulk runbook operation (``core.bulk``) for at most one
    drain budget (``ORCHESTRATOR_QUEUE_DRAIN_MAX_S``), then send itself again while it runs.
    Delivered twice, or after a worker died mid-batch, it goes on from the operation's cursor."""
    operation = bulk_operation_process(operation_id=int(operation_id), budget_s=settings.ORCHESTRATOR_QUEUE_DRAIN_MAX_S)
    if operation.status == BulkOperation.Status.RUNNING:
        bulk_runbook_send(operation.pk)
    return bulk_operation_as_dict(operation)


def bulk_runbook_send(operation_id: int) -> None:
    """Send the ``bulk_runbook`` task for an operation (``core.bulk.bulk_launcher_register`` installs it)."""
    from django_q.tasks import async_task

    try:
        async_task("jobs.tasks.bulk_runbook", operation_id, save=False, ack_failure=True)
    except Exception:  # the broker is down: the maintenance backstop sends it again
        logger.exception("could not send bulk operation %s", operation_id)
