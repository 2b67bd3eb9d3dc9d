"""Hand-written SQL the ORM would build on every call: reads that take several querysets in one
statement, and the cursor the hot statements run on."""

from __future__ import annotations

from typing import Any

from django.db import connection, connections
from django.db.models import QuerySet


def hot_cursor():
    """A cursor for hot statements (raw SQL built once per process). On PostgreSQL it binds
    parameters on the server, so psycopg prepares a statement once it ran ``prepare_threshold``
    times on the connection (parsed and planned once, not per call); it goes through Django's
    cursor wrapper all the same (execute wrappers, query logging)."""
    connection.ensure_connection()
    if connection.vendor != "postgresql":
        return connection.cursor()
    return connection._prepare_cursor(_hot_cursor_class()(connection.connection))


_HOT_CURSOR: list[type] = []


def _hot_cursor_class() -> type:
    """psycopg's server-binding cursor that keeps the statement it sent once prepared too, so
    Django's query log (``connection.queries``, the test client's captured queries) shows its text
    rather than ``None`` (psycopg records the query only when it sends it unprepared)."""
    if not _HOT_CURSOR:
        from django.db.backends.postgresql.base import ServerBindingCursor

        class HotCursor(ServerBindingCursor):
            def _send_query_prepared(self, name, pgq, *, binary=None):
                self._query = pgq
                super()._send_query_prepared(name, pgq, binary=binary)

        _HOT_CURSOR.append(HotCursor)
    return _HOT_CURSOR[0]


def subqueries_row(querysets: dict[str, QuerySet], *, wrap: str, limit: int) -> dict[str, Any]:
    """Each queryset's primary keys (at most ``limit``) put into ``wrap`` (an SQL expression with
    ``{}`` where the subquery goes, e.g. ``"EXISTS ({})"``), all read in one ``SELECT``: one round
    trip whatever the number of querysets. A queryset given an explicit ``order_by`` keeps it (the
    index meant to be walked under the limit); the others drop their default ordering."""
    if not querysets:
        return {}
    connection = connections[next(iter(querysets.values())).db]
    parts, params = [], []
    for queryset in querysets.values():
        if not queryset.query.order_by:
            queryset = queryset.order_by()
        sql, part_params = queryset.values("pk")[:limit].query.sql_with_params()
        parts.append(wrap.format(sql))
        params.extend(part_params)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {', '.join(parts)}", params)
        row = cursor.fetchone()
    return dict(zip(querysets, row))
