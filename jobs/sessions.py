"""Worker sessions (seed 004 "Worker Session Provisioning", "Cleanup and Recovery").

An agent's working context is a ``WorkerSession`` keyed ``owner::agent`` (owner
``project:<id>``, or ``session:<id>`` for an unassigned chat). For a job whose definition
names a ``session_agent``, ``worker_session_for_job``:

1. resolves or creates the session lazily (the key is unique: concurrent first jobs share it);
2. reprovisions it first when it is stale (unused for ``ORCHESTRATOR_WORKER_SESSION_STALE_S``,
   or marked stale or failed): a new generation, preflight and bootstraps to do again;
3. runs the one-time preflight of this generation (the agent's registered preflight, by
   default: the execution adapter answers ``ping``);
4. runs the optional bootstrap once per ``definition.bootstrap_key``.

When step 3 or 4 fails, the session is reset once (single reset + retry); when it fails
again, or fails after a stale reset already happened, it is marked ``failed`` and
``WorkerSessionUnavailable`` (retryable) is raised; the job's next attempt starts with one
more reset. The session row is locked while it is prepared, so preflight and bootstrap run
once even when two jobs of the same session start together.

System-owned sessions — all the ones made here — are hidden from user listings
(``worker_session_list``) and refuse user operations with ``403 system_session``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

from django.conf import settings
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from core.errors import NotFound, ValidationFailed
from core.models import Project
from core.services import audit_record, event_record, transition_log
from jobs.errors import SystemSessionRefused
from jobs.events import (
    WORKER_SESSION_BOOTSTRAPPED,
    WORKER_SESSION_CREATED,
    WORKER_SESSION_PREFLIGHT,
    WORKER_SESSION_REPROVISIONED,
    worker_session_event,
)
from jobs.models import Job, WorkerSession, WorkerSessionStatus
from jobs.registry import FatalJobError, JobDefinition, RetryableJobError

USER_OPERATIONS = frozenset({"send", "interrupt", "rollback", "archive", "rename", "delete"})
DEFAULT_PREFLIGHT = "*"

PreparationStep = Callable[[WorkerSession, "Job | None"], None]
_PREFLIGHTS: dict[str, PreparationStep] = {}
_BOOTSTRAPS: dict[str, PreparationStep] = {}


class WorkerSessionUnavailable(RetryableJobError):
    """The worker session could not be prepared, even after its single reset."""

    code = "worker_session_unavailable"


class WorkerSessionMisconfigured(FatalJobError):
    """A definition names a bootstrap key nobody registered."""

    code = "worker_session_misconfigured"


class PreflightFailed(Exception):
    """Raised by a preflight that found the worker not ready."""


def session_preflight_register(agent: str, func: PreparationStep) -> PreparationStep:
    """Register the preflight of ``agent`` (``"*"``: every agent without its own)."""
    _PREFLIGHTS[agent] = func
    return func


def session_bootstrap_register(key: str, func: PreparationStep) -> PreparationStep:
    """Register the one-time bootstrap run for definitions with ``bootstrap_key=key``."""
    _BOOTSTRAPS[key] = func
    return func


def adapter_ping_preflight(session: WorkerSession, job: Job | None) -> None:
    """The default preflight: the execution adapter answers ``ping``."""
    from jobs.commands.adapters import adapter_get

    if not adapter_get().ping():
        raise PreflightFailed("the execution adapter did not answer ping")


session_preflight_register(DEFAULT_PREFLIGHT, adapter_ping_preflight)


def worker_session_key(*, owner: str, agent: str) -> str:
    return f"{owner}::{agent}"


def worker_session_owner(*, project_id: int | None = None, session_id: str | None = None) -> str:
    """``project:<id>``, or ``session:<id>`` when no project owns the work (an unassigned chat)."""
    if project_id is not None:
        return f"project:{project_id}"
    if session_id:
        return f"session:{session_id}"
    raise ValidationFailed("a worker session needs an owner", errors={"owner": ["a project or a session id"]})


def worker_session_for_job(*, job: Job, definition: JobDefinition) -> WorkerSession:
    """The prepared session of the job's ``owner::agent`` (created, preflighted, bootstrapped)."""
    owner = worker_session_owner(project_id=job.project_id)
    return worker_session_prepare(owner=owner, agent=definition.session_agent, project_id=job.project_id,
                                  bootstrap_key=definition.bootstrap_key, job=job)


def worker_session_prepare(*, owner: str, agent: str, project_id: int | None = None,
                           bootstrap_key: str | None = None, job: Job | None = None) -> WorkerSession:
    """Resolve ``owner::agent`` and make it ready for one job; see the module docstring."""
    if not agent:
        raise ValidationFailed("a worker session needs an agent", errors={"agent": ["required"]})
    if bootstrap_key and bootstrap_key not in _BOOTSTRAPS:
        raise WorkerSessionMisconfigured(f"no bootstrap is registered for key {bootstrap_key!r}")
    session = _ensure(owner=owner, agent=agent, project_id=project_id)
    organization_id = _organization_id(session.project_id)
    failure: Exception | None = None
    with transaction.atomic():
        session = WorkerSession.objects.select_for_update().get(pk=session.pk)
        now = timezone.now()
        reset = False
        if _is_stale(session, now):
            _reprovision(session, organization_id, reason=_stale_reason(session, now))
            reset = True
        try:
            _provision(session, bootstrap_key, job, organization_id)
        except Exception as first:
            if reset:
                failure = first
            else:
                _reprovision(session, organization_id, reason=f"preparation failed: {_describe(first)}")
                try:
                    _provision(session, bootstrap_key, job, organization_id)
                except Exception as second:
                    failure = second
        if failure is not None:
            _set_status(session, WorkerSessionStatus.FAILED, organization_id, error=_describe(failure))
        else:
            session.last_used_at = timezone.now()
            session.last_error = ""
            if session.status != WorkerSessionStatus.READY:
                _set_status(session, WorkerSessionStatus.READY, organization_id)
            else:
                session.save()
    if failure is not None:
        raise WorkerSessionUnavailable(
            f"worker session {session.key} is unavailable after a reset: {_describe(failure)}") from failure
    return session


def worker_session_mark_stale(*, session_key: str, reason: str = "") -> WorkerSession:
    """Flag a session whose runtime context was lost; its next job reprovisions it once."""
    with transaction.atomic():
        session = WorkerSession.objects.select_for_update().filter(key=session_key).first()
        if session is None:
            raise NotFound(f"worker session {session_key!r} does not exist")
        if session.status != WorkerSessionStatus.STALE:
            _set_status(session, WorkerSessionStatus.STALE, _organization_id(session.project_id), error=reason)
        return session


def worker_session_list(*, user_visible: bool = True, owner: str | None = None) -> QuerySet[WorkerSession]:
    """Worker sessions; a user's listing (the default) leaves out system-owned ones."""
    sessions = WorkerSession.objects.select_related("project").order_by("key")
    if user_visible:
        sessions = sessions.filter(system_owned=False)
    if owner is not None:
        sessions = sessions.filter(owner=owner)
    return sessions


def worker_session_user_operation(*, session_key: str, operation: str, user) -> WorkerSession:
    """Check a user operation (send, interrupt, rollback, archive, rename, delete) on a session.

    Returns the session when the caller may go on; raises ``SystemSessionRefused``
    (``403 system_session``, with an audit row) for a system-owned session.
    """
    if operation not in USER_OPERATIONS:
        raise ValidationFailed("unknown session operation", errors={
            "operation": [f"{operation!r} is not one of {', '.join(sorted(USER_OPERATIONS))}"]})
    session = WorkerSession.objects.filter(key=session_key).first()
    if session is None:
        raise NotFound(f"worker session {session_key!r} does not exist")
    if session.system_owned:
        with transaction.atomic():
            audit_record(actor=user, action="worker_session_refused", target_type="worker_session",
                         target_id=session.pk, organization_id=_organization_id(session.project_id),
                         reason=f"{operation} refused: system-owned session",
                         after={"key": session.key, "operation": operation})
        raise SystemSessionRefused(f"worker session {session.key} is system-owned: {operation} is refused",
                                   session=session.key, operation=operation)
    return session


# --- internals --------------------------------------------------------------------------------

def _ensure(*, owner: str, agent: str, project_id: int | None) -> WorkerSession:
    key = worker_session_key(owner=owner, agent=agent)
    with transaction.atomic():
        # get_or_create retries the read when a concurrent first job inserted the key first.
        session, created = WorkerSession.objects.get_or_create(
            key=key, defaults={"owner": owner, "agent": agent, "project_id": project_id, "system_owned": True})
        if created:
            _emit(session, WORKER_SESSION_CREATED, _organization_id(project_id))
    return session


def _is_stale(session: WorkerSession, now) -> bool:
    if session.status in (WorkerSessionStatus.STALE, WorkerSessionStatus.FAILED):
        return True
    limit = timedelta(seconds=settings.ORCHESTRATOR_WORKER_SESSION_STALE_S)
    return session.last_used_at is not None and session.last_used_at < now - limit


def _stale_reason(session: WorkerSession, now) -> str:
    if session.status in (WorkerSessionStatus.STALE, WorkerSessionStatus.FAILED):
        return f"marked {session.status}"
    return f"unused since {session.last_used_at.isoformat()}"


def _reprovision(session: WorkerSession, organization_id: int | None, *, reason: str) -> None:
    """The single reset: a new generation whose preflight and bootstraps are still to do."""
    before = session.status
    session.generation += 1
    session.reprovision_count += 1
    session.preflight_at = None
    session.bootstrap_keys = []
    session.status = WorkerSessionStatus.PROVISIONING
    session.last_error = reason
    session.save()
    transition_log(entity="worker_session", id=session.pk, key=session.key, generation=session.generation,
                   **{"from": before, "to": session.status}, reason=reason)
    _emit(session, WORKER_SESSION_REPROVISIONED, organization_id, {"reason": reason})


def _provision(session: WorkerSession, bootstrap_key: str | None, job: Job | None,
               organization_id: int | None) -> None:
    if session.preflight_at is None:
        preflight = _PREFLIGHTS.get(session.agent) or _PREFLIGHTS[DEFAULT_PREFLIGHT]
        with transaction.atomic():  # a savepoint: a failing step leaves the session row writable
            preflight(session, job)
        session.preflight_at = timezone.now()
        session.save()
        _emit(session, WORKER_SESSION_PREFLIGHT, organization_id)
    if bootstrap_key and bootstrap_key not in session.bootstrap_keys:
        with transaction.atomic():
            _BOOTSTRAPS[bootstrap_key](session, job)
        session.bootstrap_keys = [*session.bootstrap_keys, bootstrap_key]
        session.save()
        _emit(session, WORKER_SESSION_BOOTSTRAPPED, organization_id, {"bootstrapKey": bootstrap_key})


def _set_status(session: WorkerSession, status: str, organization_id: int | None, *, error: str = "") -> None:
    before = session.status
    session.status = status
    if error:
        session.last_error = error
    session.save()
    transition_log(entity="worker_session", id=session.pk, key=session.key, generation=session.generation,
                   **{"from": before, "to": status}, reason=error)
    if status != WorkerSessionStatus.READY or before != WorkerSessionStatus.READY:
        _emit(session, worker_session_event(status), organization_id, {"error": error} if error else None)


def _emit(session: WorkerSession, event_type: str, organization_id: int | None, extra: dict | None = None) -> None:
    payload = {"sessionKey": session.key, "owner": session.owner, "agent": session.agent,
               "generation": session.generation, "status": session.status,
               "reprovisionCount": session.reprovision_count}
    payload.update(extra or {})
    event_record(type=event_type, organization_id=organization_id, project_id=session.project_id, payload=payload)


def _organization_id(project_id: int | None) -> int | None:
    if project_id is None:
        return None
    return Project.objects.filter(pk=project_id).values_list("organization_id", flat=True).first()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
