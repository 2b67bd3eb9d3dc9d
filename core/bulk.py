"""Runbooks over a whole filter: the objects an admin changelist shows for a query string, tracked.

``runbook_filter_queryset`` resolves a query string (``status=failed&project__id__exact=3``,
``stuck=yes``, ``q=...``) through the model admin's own ``ChangeList``, so list filters and
searches mean exactly what they mean in the admin. ``bulk_operation_start`` records a
``BulkOperation`` (who, which runbook, which query, why, how many) and ``bulk_operation_process``
applies the runbook to its objects in id-ordered batches through ``core.runbooks.runbook_execute``
(each object: the same service call and audit record as a single action), keeping a cursor on the
record so that processing again — a redelivered job, a second worker — goes on where it stopped
and never counts a batch twice. ``bulk_operation_abort`` asks it to stop; it looks between
batches. Each batch writes a ``bulk_operation_progress`` event.

The admin's "select all" beyond its page cap and the commands' ``--filter`` use this; the
background processing is whatever ``bulk_launcher_register`` installed (the jobs app sends a
django-q2 task), in-process when nothing is.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable
from urllib.parse import urlsplit

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.exceptions import FieldError, ImproperlyConfigured, SuspiciousOperation, ValidationError
from django.db import transaction
from django.db.models import Max, QuerySet
from django.http import HttpRequest, QueryDict
from django.urls import reverse
from django.utils import timezone

from core.errors import Conflict, NotFound, ValidationFailed
from core.events import BULK_OPERATION_PROGRESS
from core.models import BulkOperation
from core.runbooks import DONE, REFUSED, RUNBOOKS, SKIPPED, Outcome, Runbook, runbook_execute
from core.services import actor_label, audit_record, event_record, row_lock
from core.timefmt import isoformat_or_none

logger = logging.getLogger("orchestrator.runbooks")

BULK_BATCH_SIZE = 100
BULK_REFUSALS_KEPT = 100
IGNORED_PARAMETERS = ("p", "all", "e", "_changelist_filters")  # paging and the admin's error flag
MAX_QUERY_LENGTH = 4000


class AnyPermissionUser:
    """The shell's stand-in for a staff user when a changelist is resolved with no ``--as`` user:
    the shell is trusted with every object (the admin's own ``get_queryset`` still applies)."""

    pk = None
    is_active = is_staff = is_superuser = is_authenticated = True
    is_anonymous = False
    username = "shell"

    def has_perm(self, perm, obj=None) -> bool:
        return True

    def has_perms(self, perms, obj=None) -> bool:
        return True

    def has_module_perms(self, app_label) -> bool:
        return True

    def get_username(self) -> str:
        return self.username


def _query_clean(query: str) -> str:
    """The query string alone (a pasted changelist URL is accepted), without paging parameters."""
    query = (query or "").strip()
    if len(query) > MAX_QUERY_LENGTH:
        raise ValidationFailed("filter too long", errors={"filter": [f"at most {MAX_QUERY_LENGTH} characters"]})
    if "?" in query:
        query = urlsplit(query).query if "://" in query or query.startswith("/") else query.split("?", 1)[1]
    params = QueryDict(query, mutable=True)
    for name in IGNORED_PARAMETERS:
        params.pop(name, None)
    return params.urlencode()


def runbook_filter_queryset(runbook: Runbook, query: str, *, user=None) -> QuerySet:
    """The objects of ``runbook.model`` its admin changelist shows for ``query``, ordered by id.

    Resolved by the model admin's ``ChangeList`` (list filters, ``q=`` searches, lookups the admin
    allows); a parameter it refuses raises ``ValidationFailed`` naming ``filter``."""
    model_admin = admin.site._registry.get(runbook.model)
    if model_admin is None:
        raise ImproperlyConfigured(f"runbook {runbook.label}: {runbook.model._meta.label} has no admin")
    request = HttpRequest()
    request.method = "GET"
    request.GET = QueryDict(_query_clean(query))
    request.user = user if getattr(user, "pk", None) is not None else AnyPermissionUser()
    meta = runbook.model._meta
    request.path = request.path_info = reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist")
    try:
        changelist = model_admin.get_changelist_instance(request)
        queryset = changelist.get_queryset(request)
        str(queryset.query)  # a bad lookup value fails here, not in the middle of the operation
    except (IncorrectLookupParameters, SuspiciousOperation, FieldError, ValidationError, ValueError,
            TypeError) as exc:
        detail = "; ".join(getattr(exc, "messages", None) or [str(exc) or type(exc).__name__])
        detail = detail if len(detail) <= 200 else detail[:200] + "…"
        raise ValidationFailed("invalid filter", errors={"filter": [
            f"the {meta.verbose_name} list refuses {query!r}: {detail}"]}) from exc
    return queryset.order_by("pk")


def bulk_operation_start(*, runbook: Runbook, query: str, actor, reason: str, options: dict | None = None,
                         queryset: QuerySet | None = None) -> BulkOperation:
    """Record a bulk operation over the objects ``query`` selects (``queryset`` when already
    resolved) and audit it; nothing is processed yet (``bulk_operation_launch``)."""
    reason = (reason or "").strip()
    if runbook.reason_required and not reason:
        raise ValidationFailed("a reason is required", errors={"reason": ["must not be empty"]})
    query = _query_clean(query)
    if queryset is None:
        queryset = runbook_filter_queryset(runbook, query, user=actor)
    summary = queryset.order_by().aggregate(total=Max("pk"))
    with transaction.atomic():
        operation = BulkOperation.objects.create(
            runbook=runbook.label, query=query, options=options or {}, reason=reason,
            actor=actor if getattr(actor, "pk", None) else None, actor_label=actor_label(actor),
            total=queryset.count(), last_pk=summary["total"] or 0)
        audit_record(actor=actor, action="bulk_operation_start", target_type="bulk_operation",
                     target_id=operation.pk, reason=reason,
                     after={"runbook": runbook.label, "query": query, "total": operation.total})
        _progress_event(operation)
    return operation


# --- background processing -------------------------------------------------------------------

_LAUNCHERS: list[Callable[[int], None]] = []


def bulk_launcher_register(launch: Callable[[int], None]) -> None:
    """Install how a bulk operation is processed in the background: ``launch(operation_id)``,
    called after the operation's transaction commits (the jobs app sends a django-q2 task)."""
    _LAUNCHERS[:] = [launch]


def bulk_operation_launch(operation: BulkOperation) -> None:
    """Process ``operation`` in the background (in-process when no launcher is installed)."""
    operation_id = operation.pk
    if _LAUNCHERS:
        transaction.on_commit(lambda: _LAUNCHERS[0](operation_id))
    else:
        transaction.on_commit(lambda: bulk_operation_process(operation_id=operation_id))


def _runbook_of(operation: BulkOperation) -> Runbook:
    runbook = RUNBOOKS.get(operation.runbook)
    if runbook is None:
        raise NotFound(f"runbook {operation.runbook!r} is not registered")
    return runbook


class LabelActor:
    """An actor audited by label only, with no user row behind it (the shell's ``shell:<name>``)."""

    pk = None

    def __init__(self, label: str) -> None:
        self.username = label

    def get_username(self) -> str:
        return self.username

    def __str__(self) -> str:
        return self.username


def _actor_of(operation: BulkOperation):
    if operation.actor_id is not None and operation.actor is not None:
        return operation.actor
    return LabelActor(operation.actor_label)


def _progress_event(operation: BulkOperation) -> None:
    event_record(type=BULK_OPERATION_PROGRESS, organization_id=None, payload=bulk_operation_as_dict(operation))


def bulk_operation_as_dict(operation: BulkOperation) -> dict[str, Any]:
    """The operation's progress, as the admin page polls it and the event carries it."""
    return {"operationId": operation.pk, "runbook": operation.runbook, "status": operation.status,
            "total": operation.total, "done": operation.done, "skipped": operation.skipped,
            "refused": operation.refused, "processed": operation.processed, "cursor": operation.cursor,
            "abortRequestedBy": operation.abort_requested_by, "refusals": operation.refusals[:20],
            "startedAt": isoformat_or_none(operation.started_at),
            "finishedAt": isoformat_or_none(operation.finished_at)}


def _finish(operation_id: int, status: str) -> BulkOperation:
    with transaction.atomic():
        operation = row_lock(BulkOperation, operation_id, entity="bulk operation")
        if operation.status == BulkOperation.Status.RUNNING:
            operation.status = status
            operation.finished_at = timezone.now()
            operation.save(update_fields=["status", "finished_at", "updated_at"])
            _progress_event(operation)
        return operation


def _record_batch(operation_id: int, *, cursor_before: int, cursor_after: int, outcomes: list[Outcome]) -> bool:
    """Count one batch's outcomes and move the cursor, unless another processor did that batch
    first (then nothing is counted twice). Returns whether this batch was recorded."""
    with transaction.atomic():
        operation = row_lock(BulkOperation, operation_id, entity="bulk operation")
        if operation.cursor != cursor_before or operation.status != BulkOperation.Status.RUNNING:
            return False
        for outcome in outcomes:
            if outcome.result == DONE:
                operation.done += 1
            elif outcome.result == SKIPPED:
                operation.skipped += 1
            elif outcome.result == REFUSED:
                operation.refused += 1
                if len(operation.refusals) < BULK_REFUSALS_KEPT:
                    operation.refusals.append({"id": outcome.target.pk, "detail": outcome.detail})
        operation.cursor = cursor_after
        operation.save(update_fields=["done", "skipped", "refused", "refusals", "cursor", "updated_at"])
        _progress_event(operation)
        return True


def bulk_operation_process(*, operation_id: int, batch_size: int = BULK_BATCH_SIZE, budget_s: float | None = None,
                           on_outcomes: Callable[[list[Outcome]], None] | None = None) -> BulkOperation:
    """Apply the operation's runbook to its objects, a batch at a time in id order, until none is
    left (``finished``), an abort was asked for (``aborted``) or ``budget_s`` seconds are spent
    (still ``running``: process it again to go on). Idempotent: an operation that ended is left
    as it is, and a batch another processor recorded first is not counted again (its objects,
    done meanwhile, would only be skipped)."""
    operation = BulkOperation.objects.filter(pk=operation_id).first()
    if operation is None:
        raise NotFound(f"bulk operation {operation_id} does not exist")
    if operation.status != BulkOperation.Status.RUNNING:
        return operation
    runbook = _runbook_of(operation)
    actor = _actor_of(operation)
    reason = f"{operation.reason} (bulk operation {operation.pk})"
    try:
        queryset = runbook_filter_queryset(runbook, operation.query, user=operation.actor)
    except ValidationFailed:
        logger.exception("bulk operation %s: its filter no longer resolves", operation.pk)
        return _finish(operation.pk, BulkOperation.Status.ABORTED)
    deadline = None if budget_s is None else time.monotonic() + budget_s
    while True:
        operation = BulkOperation.objects.get(pk=operation_id)
        if operation.status != BulkOperation.Status.RUNNING:
            return operation
        if operation.abort_requested_by:
            return _finish(operation.pk, BulkOperation.Status.ABORTED)
        batch = list(queryset.filter(pk__gt=operation.cursor, pk__lte=operation.last_pk)[:batch_size])
        if not batch:
            return _finish(operation.pk, BulkOperation.Status.FINISHED)
        outcomes = runbook_execute(runbook, batch, actor=actor, reason=reason, options=operation.options)
        recorded = _record_batch(operation.pk, cursor_before=operation.cursor, cursor_after=batch[-1].pk,
                                 outcomes=outcomes)
        if recorded and on_outcomes is not None:
            on_outcomes(outcomes)
        if deadline is not None and time.monotonic() >= deadline:
            return BulkOperation.objects.get(pk=operation_id)


def bulk_operation_abort(*, operation_id: int, actor) -> BulkOperation:
    """Ask a running operation to stop: it does after the batch in progress (audited)."""
    with transaction.atomic():
        operation = row_lock(BulkOperation, operation_id, entity="bulk operation")
        if operation.status != BulkOperation.Status.RUNNING:
            raise Conflict(f"bulk operation {operation.pk} is {operation.status}: nothing to abort")
        if not operation.abort_requested_by:
            operation.abort_requested_by = actor_label(actor)
            operation.save(update_fields=["abort_requested_by", "updated_at"])
            audit_record(actor=actor, action="bulk_operation_abort", target_type="bulk_operation",
                         target_id=operation.pk, after={"processed": operation.processed, "total": operation.total})
        return operation
