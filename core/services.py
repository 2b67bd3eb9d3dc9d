"""Writers shared by every app: event rows, audit rows, tenancy onboarding."""

from __future__ import annotations

import json
import logging
from typing import Any

from django.db import connection, transaction
from django.db.models import Model
from django.utils import timezone

from core.errors import NotFound, ValidationFailed
from core.events import PROJECT_CREATED
from core.fsm import moves_counts_sql, moves_statement, moves_take, moves_written, sqlite_moves_written
from core.models import AuditRecord, Event, Organization, Project
from core.sql import hot_cursor, per_vendor
from core.tracing import tracing_trace_id

logger = logging.getLogger("orchestrator.transitions")


def event_record(
    *,
    type: str,
    organization_id: int | None,
    project_id: int | None = None,
    run_id: int | None = None,
    payload: dict[str, Any] | None = None,
) -> Event:
    """Write one outbox event in the caller's transaction (rolled back with it)."""
    event = Event.objects.create(
        type=type,
        organization_id=organization_id,
        project_id=project_id,
        run_id=run_id,
        payload=payload or {},
    )
    return event


def events_record(rows: list[dict[str, Any]]) -> None:
    """Write several outbox events in one statement, in the caller's transaction, in the order
    given (their ids increase in that order). Each row takes ``event_record``'s keyword arguments.
    The rows travel as one JSON document through a statement built once: no model instance, no
    SQL built per call (on PostgreSQL prepared once per connection, ``hot_cursor``); the row moves
    ``core.fsm.moves_put_off`` kept are written by the same statement."""
    if not rows:
        return
    document = json.dumps([[row["type"], row.get("organization_id"), row.get("project_id"), row.get("run_id"),
                            row.get("payload") or {}] for row in rows], separators=(",", ":"))
    params = [connection.ops.adapt_datetimefield_value(timezone.now()), document]
    moves = moves_take()
    if connection.vendor != "postgresql":
        if moves:
            sqlite_moves_written(moves, [(_EVENTS_INSERT_SQLITE, params, False)])
        else:
            with hot_cursor() as cursor:
                cursor.execute(_EVENTS_INSERT_SQLITE, params)
        return
    with hot_cursor() as cursor:
        if not moves:
            cursor.execute(_EVENTS_INSERT, params)
            return
        with_sql, with_params = moves_statement(moves)
        cursor.execute(_events_insert_with_sql(with_sql, len(moves)), [*with_params, *params])
        inserted = cursor.fetchall()
    moves_written(moves, inserted[0][1])


# One row per element of a JSON array of [type, organization_id, project_id, run_id, payload],
# inserted in the array's order (``WITH ORDINALITY``), so the ids increase in that order.
_EVENTS_INSERT = (
    f"INSERT INTO {Event._meta.db_table} (type, organization_id, project_id, run_id, payload, created_at)"
    " SELECT e.value->>0, (e.value->>1)::bigint, (e.value->>2)::bigint, (e.value->>3)::bigint, e.value->4, %s::timestamptz"
    " FROM jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS e(value, n) ORDER BY e.n RETURNING id"
)


# The same on SQLite (``json_each`` walks the array in its order).
_EVENTS_INSERT_SQLITE = (
    f"INSERT INTO {Event._meta.db_table} (type, organization_id, project_id, run_id, payload, created_at)"
    " SELECT json_extract(e.value, '$[0]'), json_extract(e.value, '$[1]'), json_extract(e.value, '$[2]'),"
    " json_extract(e.value, '$[3]'), json_extract(e.value, '$[4]'), %s FROM json_each(%s) AS e ORDER BY e.key"
)


def events_statement(rows: list[dict[str, Any]], name: str = "ev") -> tuple[str, list]:
    """``events_record``'s INSERT of ``rows`` as a part of a ``WITH`` (``name AS (...)``) and its
    parameters (PostgreSQL): for a write of the caller's that records them in the same statement."""
    document = json.dumps([[row["type"], row.get("organization_id"), row.get("project_id"), row.get("run_id"),
                            row.get("payload") or {}] for row in rows], separators=(",", ":"))
    return f"{name} AS ({_EVENTS_INSERT})", [connection.ops.adapt_datetimefield_value(timezone.now()), document]


@per_vendor
def _events_insert_with_sql(with_sql: str, moves: int) -> str:
    """``_EVENTS_INSERT`` after a ``WITH`` of row moves, returning their row counts on every row."""
    return f"{with_sql} {_EVENTS_INSERT}, {moves_counts_sql(moves)}"


# Keys every transition line carries (None when they do not apply), and the names call sites
# may use for them.
TRANSITION_KEYS = ("entity", "type", "project_id", "run_id", "attempt", "from", "to", "reason")
TRANSITION_ALIASES = {"project": "project_id", "run": "run_id", "organization": "organization_id"}


def row_lock(model: type[Model], pk: Any, *, entity: str, related: tuple[str, ...] = ()) -> Model:
    """The ``model`` row with primary key ``pk``, locked until the transaction ends
    (``SELECT ... FOR UPDATE``), with ``related`` joined in. A missing row or a malformed key
    raises ``NotFound`` ("<entity> <pk> does not exist")."""
    rows = model.objects.select_for_update()
    if related:
        rows = rows.select_related(*related)
    try:
        return rows.get(pk=pk)
    except (model.DoesNotExist, ValueError, TypeError) as exc:
        raise NotFound(f"{entity} {pk} does not exist") from exc


def transition_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields of one transition line, named the same way for every entity.

    ``id`` becomes ``<entity>_id`` (``job_id``, ``run_id`` ...); ``project``/``run``/``organization``
    become ``project_id``/``run_id``/``organization_id``; ``type`` defaults to the entity (a run's
    lines say ``"type": "run"``, a job's its job type); the keys of ``TRANSITION_KEYS`` are
    always present.
    """
    entity = str(fields.get("entity") or "object")
    line: dict[str, Any] = {key: None for key in TRANSITION_KEYS}
    line["entity"] = entity
    line["type"] = entity
    for key, value in fields.items():
        if key == "id":
            line[f"{entity}_id"] = value
        elif key != "entity":
            line[TRANSITION_ALIASES.get(key, key)] = value
    if line["reason"] is None:
        line["reason"] = ""
    return line


def transition_log(**fields: Any) -> None:
    """One structured log record per state transition on logger ``orchestrator.transitions``.

    The record's ``fields`` (see ``transition_fields``) become the keys of its JSON line
    (``core.logging.JsonFormatter``): ``entity``, ``<entity>_id``, ``project_id``, ``run_id``,
    ``type``, ``attempt``, ``from``, ``to``, ``reason`` and whatever else the caller adds, and
    ``trace_id`` when tracing is on and a span is active (``core.tracing``).

    Written when the caller's transaction commits (at once outside one): a transition rolled
    back never appears in the log.
    """
    if not logger.isEnabledFor(logging.INFO):
        return
    line = transition_fields(fields)
    entity = line["entity"]
    trace_id = tracing_trace_id()
    if trace_id:
        line["trace_id"] = trace_id

    def write() -> None:
        logger.info("%s %s %s -> %s", entity, line.get(f"{entity}_id"), line["from"], line["to"],
                    extra={"fields": {"event": "transition", **line}})

    transaction.on_commit(write, robust=True)


def actor_label(actor) -> str:
    if actor is None:
        return "system"
    return getattr(actor, "get_username", lambda: str(actor))()


def audit_record(
    *,
    actor,
    action: str,
    target_type: str,
    target_id: Any,
    reason: str = "",
    before: dict | None = None,
    after: dict | None = None,
    organization_id: int | None = None,
    run_id: int | None = None,
) -> AuditRecord:
    """Write one audit row (who, what, why, before → after) in the caller's transaction."""
    return AuditRecord.objects.create(
        actor=actor if getattr(actor, "pk", None) else None,
        actor_label=actor_label(actor),
        action=action,
        target_type=target_type,
        target_id=str(target_id),
        organization_id=organization_id,
        run_id=run_id,
        reason=reason or "",
        before=before or {},
        after=after or {},
    )


def organization_get(*, ref: str | int) -> Organization:
    """Find an organization by id or exact name, or raise ``NotFound``."""
    queryset = Organization.objects.all()
    organization = None
    if isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit()):
        organization = queryset.filter(pk=int(ref)).first()
    if organization is None:
        organization = queryset.filter(name=str(ref)).first()
    if organization is None:
        raise NotFound(f"organization {ref!r} does not exist")
    return organization


@transaction.atomic
def project_create(*, organization: Organization, name: str, actor=None) -> Project:
    """Create a project in an organization (names unique per organization)."""
    name = (name or "").strip()
    if not name:
        raise ValidationFailed("invalid project", errors={"name": ["must not be empty"]})
    if Project.objects.filter(organization=organization, name=name).exists():
        raise ValidationFailed("invalid project", errors={"name": [f"project {name!r} already exists"]})
    project = Project.objects.create(organization=organization, name=name)
    event_record(type=PROJECT_CREATED, organization_id=organization.pk, project_id=project.pk,
                 payload={"project": project.pk, "name": name})
    audit_record(actor=actor, action="project_create", target_type="project", target_id=project.pk,
                 organization_id=organization.pk, after={"name": name})
    return project
