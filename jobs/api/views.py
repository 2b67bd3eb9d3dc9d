"""Jobs (enqueue with seed 003's wait-or-202, get, list, cancel) and the health check."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.utils import timezone
from django_filters import rest_framework as filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status
from rest_framework.authentication import SessionAuthentication
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import AllowAny
from rest_framework.response import Response

from core.api.base import ApiView, ApiViewSet
from core.api.pagination import KeysetPagination
from core.api.schema import errors, list_retrieve_schema
from core.api.serializers import HealthSerializer
from core.api.tenancy import VisibleIdFilter, as_id, organization_ids, visible_projects
from core.errors import NotFound, PermissionRefused, ValidationFailed
from jobs.api.serializers import (
    JobCancelSerializer,
    JobEnqueuedSerializer,
    JobEnqueueSerializer,
    JobSerializer,
    QueueChangeSerializer,
    QueueStateSerializer,
)
from jobs.commands.job import command_job_credits_check
from jobs.errors import CommandConflict
from core.models import Membership, Project
from jobs.models import CommandRecord, Job, JobState, WorkerHeartbeat, WorkerSession
from jobs.registry import definition_get
from jobs.services import job_as_dict, job_cancel, job_enqueue, queue_pause, queue_resume
from jobs.sessions import worker_session_user_operation

logger = logging.getLogger("orchestrator.api")

WAIT_POLL_S = (0.01, 0.2)  # first and longest pause between two looks at a waited-for job
WORKERS_SEEN_WINDOW = timedelta(minutes=1)


def job_wait(job_id: int, timeout_s: float) -> Job:
    """The job once it is terminal, or as it is when ``timeout_s`` has passed.

    Between two looks it holds no database connection (it gives it back, to the pool when there
    is one): a request may wait seconds, and waiting requests must not use up the connections
    the workers that would finish their jobs need. Inside a transaction (never in a request that
    waits: its handler commits first) the connection is the transaction's and stays.
    """
    deadline = time.monotonic() + timeout_s
    pause = WAIT_POLL_S[0]
    while True:
        job = Job.objects.get(pk=job_id)
        remaining = deadline - time.monotonic()
        if job.is_terminal or remaining <= 0:
            return job
        if not connection.in_atomic_block:
            connection.close()
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, WAIT_POLL_S[1])


def _payload_validated(job_type: str, payload: dict) -> dict:
    definition = definition_get(job_type)
    try:
        return definition.validated(payload)
    except ValidationFailed:
        raise
    except Exception as exc:  # a validator that trips over a malformed payload: still bad input
        raise ValidationFailed("invalid payload", errors={
            "payload": [f"rejected by the {job_type} validator ({type(exc).__name__})"]}) from exc


def _source_session_check(request, session_key: str) -> None:
    """A system-owned worker session refuses user work (``403 system_session``)."""
    session = WorkerSession.objects.select_related("project").filter(key=session_key).first()
    if session is None:
        return  # a user session of the caller's client: nothing to check here
    if session.project_id is not None and session.project.organization_id not in organization_ids(request):
        raise NotFound(f"worker session {session_key!r} does not exist")
    worker_session_user_operation(session_key=session_key, operation="send", user=request.user)


def _command_conflict_check(project, payload: dict) -> None:
    """The same command key with another payload fails now (``409 command_conflict``), not later
    in the worker."""
    from jobs.commands.validation import command_args_validate, payload_hash
    from jobs.models import CommandKind

    key = payload.get("idempotency_key")
    if not key:
        return
    if "tool" in payload:
        kind, args = CommandKind.INVOKE_TOOL, {"tool": payload["tool"], "args": payload.get("args", {})}
    else:
        kind, args = payload["command"], payload.get("args", {})
    digest = payload_hash(command_args_validate(kind, args))
    recorded = (CommandRecord.objects.filter(project=project, kind=kind, idempotency_key=key)
                .values_list("payload_hash", "pk").first())
    if recorded is not None and recorded[0] != digest:
        raise CommandConflict(f"idempotency key {key!r} of command {kind} was recorded with another payload",
                              kind=kind, idempotency_key=key, command_id=recorded[1])


class JobFilter(filters.FilterSet):
    project = VisibleIdFilter(field_name="project_id", entity="project", queryset=visible_projects)
    state = filters.ChoiceFilter(choices=JobState.choices)
    type = filters.CharFilter(field_name="type", max_length=100)

    class Meta:
        model = Job
        fields = ["project", "state", "type"]


def _queue_action(url_path: str, summary: str, description: str):
    """A POST on one project's queue (pause, resume), with its schema: a reason in, the queue's state out."""
    schema = extend_schema(description=description, summary=summary, request=QueueChangeSerializer,
                           responses={200: QueueStateSerializer, **errors("validation_error", "not_found",
                                                                          "permission_denied", "queue_pause_conflict")})
    return lambda method: schema(action(detail=True, methods=["post"], url_path=url_path)(method))


@list_retrieve_schema(
    JobSerializer,
    list_summary="Jobs of the caller's organizations (by project, state, type)",
    list_description="Jobs of the caller's organizations, newest first; filter by `project`, `state` and `type`.",
    retrieve_summary="A job",
    retrieve_description="One job: its type, state, reason, attempts, timings, result or error.",
)
class JobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ApiViewSet):
    queryset = Job.objects.order_by("-id")
    pagination_class = KeysetPagination
    serializer_class = JobSerializer
    filterset_class = JobFilter
    entity = "job"

    def idempotency_atomic(self, request) -> bool:
        # A request that waits for a worker must commit its job first (and not hold a transaction).
        data = request.data
        return not (self.action == "create" and isinstance(data, dict) and data.get("wait_ms"))

    @extend_schema(
        description=("Enqueues a job of a registered type for a project (deduplicated by the type's rule). With "
                     "`wait_ms`, waits that long for it to finish and answers its result (200), or 202 with the job "
                     "to poll. A full queue answers 429 `queue_full` with a retry hint."),
        summary="Enqueue a job; with wait_ms, its result when it finishes in time (else 202)",
        request=JobEnqueueSerializer,
        responses={202: JobEnqueuedSerializer, 200: JobEnqueuedSerializer,
                   **errors("validation_error", "not_found", "system_session", "command_conflict",
                            "insufficient_credits", "queue_full", "queue_disabled")})
    def create(self, request):
        serializer = JobEnqueueSerializer(data=request.data)
        valid = serializer.is_valid()
        project_id = as_id(request.data.get("project")) if isinstance(request.data, dict) else None
        project = self.project_visible(request, project_id) if project_id else None
        if not valid:
            raise ValidationError(serializer.errors)
        data = serializer.validated_data
        job_type = data["type"]
        if job_type not in settings.ORCHESTRATOR_API_JOB_TYPES or definition_get(job_type) is None:
            allowed = ", ".join(t for t in settings.ORCHESTRATOR_API_JOB_TYPES if definition_get(t))
            raise ValidationFailed("unknown job type", errors={"type": [f"{job_type!r} is not a job type "
                                                                        f"clients may enqueue; one of {allowed}"]})
        payload = _payload_validated(job_type, data["payload"])
        session_key = data.get("sourceSessionId") or ""
        if session_key:
            _source_session_check(request, session_key)
        if job_type == "command":
            _command_conflict_check(project, payload)
            command_job_credits_check(project=project, payload=payload)
        result = job_enqueue(job_type=job_type, project=project, payload=payload, source_session_id=session_key,
                             actor=request.user)
        job = result.job
        wait_ms = min(data.get("wait_ms") or 0, settings.ORCHESTRATOR_SUGGEST_REPLY_WAIT_MS)
        if wait_ms > 0:
            job = job_wait(job.pk, wait_ms / 1000)
            if job.is_terminal:
                return Response({"status": job.state, "dedupe": result.dedupe, **job_as_dict(job)})
        return Response({"status": "queued", "dedupe": result.dedupe, **job_as_dict(job)},
                        status=status.HTTP_202_ACCEPTED)

    @extend_schema(description=("Cancels a waiting job at once; an executing job is asked to stop and ends cancelled "
                                "when its worker sees it. A terminal job answers 409 `job_conflict`."),
                   summary="Cancel a job (an executing one is asked to stop)", request=JobCancelSerializer,
                   responses={200: JobSerializer, **errors("not_found", "permission_denied", "job_conflict")})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        serializer = JobCancelSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        job = self.get_object()
        if job.type not in settings.ORCHESTRATOR_API_JOB_TYPES:
            raise PermissionRefused(f"job {job.pk} ({job.type}) belongs to the run engine; act on its run instead")
        job = job_cancel(job_id=job.pk, reason=serializer.validated_data["reason"], actor=request.user)
        return Response(job_as_dict(job))


class ProjectQueueViewSet(ApiViewSet):
    """A project's queue: pause and resume (its organization's owners only)."""

    queryset = Project.objects.order_by("id")
    entity = "project"

    def _change(self, request, service, *, paused: bool):
        project = self.get_object()
        if not Membership.objects.filter(user=request.user, organization_id=project.organization_id,
                                         role=Membership.Role.OWNER).exists():
            raise PermissionRefused(f"pausing or resuming the queue of project {project.pk} needs the owner role of "
                                    "its organization")
        serializer = QueueChangeSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        pause = service(project_id=project.pk, actor=request.user, reason=serializer.validated_data["reason"])
        return Response({"project": project.pk, "paused": paused, "by": request.user.get_username(),
                         "reason": serializer.validated_data["reason"], "since": pause.since})

    @_queue_action("queue/pause", "Pause a project's queue",
                   "Pauses the project's queue: its jobs stay queued (enqueueing goes on), no worker claims them and "
                   "its runs wait, until it is resumed. The organization's owners only; audited. A paused queue "
                   "answers 409 `queue_pause_conflict`.")
    def pause(self, request, pk=None):
        return self._change(request, queue_pause, paused=True)

    @_queue_action("queue/resume", "Resume a project's queue",
                   "Resumes the project's paused queue: its jobs are claimed again, in order. The organization's "
                   "owners only; audited. A queue that is not paused answers 409 `queue_pause_conflict`.")
    def resume(self, request, pk=None):
        return self._change(request, queue_resume, paused=False)


def _health_database() -> dict:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return {"ok": True, "vendor": connection.vendor}


def _health_broker() -> dict:
    from django_q.brokers import get_broker

    broker = get_broker()
    return {"ok": bool(broker.ping()), "backlog": broker.queue_size() or 0, "info": broker.info()}


def _health_workers() -> dict:
    seen = WorkerHeartbeat.objects.filter(last_seen__gte=timezone.now() - WORKERS_SEEN_WINDOW).count()
    return {"ok": seen > 0, "seen_last_minute": seen}


def _health_relay() -> dict | str:
    try:
        from core.relay import relay_status
    except ImportError:
        return "not running"
    state = relay_status()
    if state is None:
        return "not running"
    return {"ok": state["lag"] <= settings.ORCHESTRATOR_HEALTH_MAX_RELAY_LAG, **state}


def _health_queue() -> dict:
    enabled = bool(settings.ORCHESTRATOR_QUEUE_ENABLED)
    return {"ok": enabled, "enabled": enabled}


HEALTH_CHECKS = {"database": _health_database, "broker": _health_broker, "workers": _health_workers,
                 "relay": _health_relay, "queue": _health_queue}


def _health_details_allowed(request) -> bool:
    """The parts and their details are for staff (a session or an API token) and for the metrics
    token (``ORCHESTRATOR_METRICS_TOKEN``, as ``Authorization: Bearer``); anyone else gets the status."""
    from rest_framework.authentication import TokenAuthentication
    from rest_framework.exceptions import APIException

    from core.metrics import metrics_access

    if metrics_access(request) is None:  # the metrics token, or a staff session
        return True
    try:
        authenticated = TokenAuthentication().authenticate(request)
    except APIException:  # a wrong token: just not staff
        return False
    return authenticated is not None and authenticated[0].is_active and authenticated[0].is_staff


class HealthView(ApiView):
    """Database, broker, workers seen in the last minute, relay lag, queue enabled.

    No authentication is needed for the status (``ok``/``failing``, 200/503); the parts, with a
    failing part's error, only for staff and the metrics token."""

    permission_classes = [AllowAny]
    authentication_classes = [SessionAuthentication]  # a staff session sees the parts; a token: see below
    throttle_classes = []

    @extend_schema(description=("Checks the database, the broker, the workers' heartbeats and the queue; no "
                                "credentials needed. Anonymous callers get only ok or failing; staff and the "
                                "metrics token also get the parts and the names of the failing ones."),
                   summary="Health: 200 when every part is ok, else 503; staff and the metrics token also get "
                           "the parts and the names of the failing ones",
                   responses={200: HealthSerializer, 503: HealthSerializer})
    def get(self, request):
        parts: dict = {}
        for name, check in HEALTH_CHECKS.items():
            try:
                parts[name] = check()
            except Exception as exc:  # a failing part is reported, never raised
                logger.warning("health: %s failed: %s: %s", name, type(exc).__name__, exc)
                parts[name] = {"ok": False, "detail": f"{type(exc).__name__}: {exc}"}
        failing = [name for name, part in parts.items() if isinstance(part, dict) and not part.get("ok")]
        body = {"status": "failing" if failing else "ok"}
        if _health_details_allowed(request):
            body.update({"failing": failing, **parts})
        return Response(body, status=status.HTTP_503_SERVICE_UNAVAILABLE if failing else status.HTTP_200_OK)
