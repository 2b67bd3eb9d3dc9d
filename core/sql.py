"""Hand-written SQL the ORM would build on every call: reads that take several querysets in one
statement (a row of subqueries, a bounded count of a union), the cursor the hot statements run on,
and model rows read by statements written once."""

from __future__ import annotations

from typing import Any

from django.db import connection, connections
from django.db.models import QuerySet


def per_vendor(build):
    """``build(*args)`` (an SQL text built from the connection's vendor, quoting, features) called once
    per vendor and arguments, then served from memory: a hot statement's text is written once."""
    built: dict[tuple, Any] = {}

    def cached(*args):
        key = (connection.vendor, *args)
        if key not in built:
            built[key] = build(*args)
        return built[key]

    cached.__name__, cached.__doc__ = build.__name__, build.__doc__
    return cached


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


def subqueries_row(querysets: dict[str, QuerySet], *, wrap: str, limit: int | dict[str, int]) -> dict[str, Any]:
    """Each queryset's primary keys (at most ``limit``, or ``limit[key]`` per queryset) put into
    ``wrap`` (an SQL expression with ``{}`` where the subquery goes, e.g. ``"EXISTS ({})"``), all
    read in one ``SELECT``: one round trip whatever the number of querysets. A queryset given an
    explicit ``order_by`` keeps it (the index meant to be walked under the limit); the others drop
    their default ordering."""
    if not querysets:
        return {}
    connection = connections[next(iter(querysets.values())).db]
    parts, params = [], []
    for key, queryset in querysets.items():
        if not queryset.query.order_by:
            queryset = queryset.order_by()
        bound = limit[key] if isinstance(limit, dict) else limit
        sql, part_params = queryset.values("pk")[:bound].query.sql_with_params()
        parts.append(wrap.format(sql))
        params.extend(part_params)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {', '.join(parts)}", params)
        row = cursor.fetchone()
    return dict(zip(querysets, row))


class ModelRows:
    """A model's concrete columns for hand-written SQL (``columns(alias)``) and its instances built
    from those values as the ORM builds them (``load``: its converters, ``Model.from_db``), for
    hot reads whose statement is written once rather than compiled per call."""

    def __init__(self, model: type):
        self.model = model
        self.fields = list(model._meta.concrete_fields)
        self.names = [field.attname for field in self.fields]
        self.width = len(self.fields)
        self._converters: dict[str, list] = {}
        self._by_pk: dict[tuple[str, bool], str] = {}

    def columns(self, alias: str) -> str:
        qn = connection.ops.quote_name
        return ", ".join(f"{alias}.{qn(field.column)}" for field in self.fields)

    def _converters_now(self) -> list:
        found = self._converters.get(connection.vendor)
        if found is None:
            found = []
            for index, field in enumerate(self.fields):
                expression = field.get_col(self.model._meta.db_table)
                functions = connection.ops.get_db_converters(expression) + expression.get_db_converters(connection)
                if functions:
                    found.append((index, expression, functions))
            self._converters[connection.vendor] = found
        return found

    def by_pk(self, pk, *, lock: bool = False):
        """The row whose primary key is ``pk`` (``lock``: ``FOR UPDATE`` where the database has it),
        or None: one prepared statement, not compiled per call."""
        key = (connection.vendor, lock)
        sql = self._by_pk.get(key)
        if sql is None:
            qn = connection.ops.quote_name
            suffix = " FOR UPDATE" if lock and connection.features.has_select_for_update else ""
            sql = self._by_pk[key] = (f"SELECT {self.columns('m')} FROM {qn(self.model._meta.db_table)} m"
                                      f" WHERE m.{qn(self.model._meta.pk.column)} = %s{suffix}")
        with hot_cursor() as cursor:
            cursor.execute(sql, [pk])
            row = cursor.fetchone()
        return None if row is None else self.load(row)

    def load(self, row, start: int = 0):
        """The instance whose values are ``row[start:start + width]``."""
        values = list(row[start:start + self.width])
        for index, expression, functions in self._converters_now():
            value = values[index]
            for function in functions:
                value = function(value, expression, connection)
            values[index] = value
        return self.model.from_db(connection.alias, self.names, values)


def insert_returning(instance, returning: str = "", params: list | tuple = (), *, with_: str = "") -> Any:
    """Insert the new ``instance`` (its fields as ``save`` writes them: ``pre_save`` fills ``auto_now``
    and the like) by one prepared statement built once per model and ``returning`` (an SQL expression
    read in the same statement, ``params`` its parameters; none by default); the instance gets its
    primary key, and the expression's value is returned. No ``pre_save`` or ``post_save`` signal is
    sent: for rows nothing listens to, written where ``Model.objects.create`` would compile the
    same ``INSERT`` on every call. ``with_``: a ``WITH`` clause put before the ``INSERT`` (its
    parameters first in ``params``, which then go before the row's values); ``returning`` may
    read its parts (``core.fsm.save_moved_together``)."""
    model = type(instance)
    fields = [field for field in model._meta.concrete_fields if not field.primary_key]
    values = [field.get_db_prep_save(field.pre_save(instance, True), connection) for field in fields]
    with hot_cursor() as cursor:
        cursor.execute(_insert_returning_sql(model, returning, with_),
                       [*params, *values] if with_ else [*values, *params])
        row = cursor.fetchone()
    instance.pk = row[0]
    instance._state.adding, instance._state.db = False, connection.alias
    return row[1] if returning else None


@per_vendor
def _insert_returning_sql(model, returning: str, with_: str = "") -> str:
    qn = connection.ops.quote_name
    meta = model._meta
    columns = [qn(field.column) for field in meta.concrete_fields if not field.primary_key]
    return (f"{with_ + ' ' if with_ else ''}INSERT INTO {qn(meta.db_table)} ({', '.join(columns)}) VALUES ({', '.join(['%s'] * len(columns))})"
            f" RETURNING {qn(meta.pk.column)}{', ' + returning if returning else ''}")


def union_count(querysets: list[QuerySet], *, limit: int) -> int:
    """The rows of disjoint ``querysets`` together, counted up to ``limit``: one ``SELECT COUNT(*)``
    over ``(q1 LIMIT n) UNION ALL (q2 LIMIT n) ...`` under ``LIMIT n``, so that the parts are read
    in turn and the reading stops after ``limit`` rows whatever the parts hold. Each part keeps an
    explicit ``order_by`` (the index meant to be walked). An engine that cannot limit the parts of
    a compound query (SQLite) counts each part up to ``limit`` in one ``SELECT`` instead."""
    if not querysets:
        return 0
    connection = connections[querysets[0].db]
    if not connection.features.supports_slicing_ordering_in_compound:
        counted = subqueries_row(dict(enumerate(querysets)), wrap="(SELECT COUNT(*) FROM ({}) AS bounded)",
                                 limit=limit)
        return min(limit, sum(int(count) for count in counted.values()))
    parts, params = [], []
    for queryset in querysets:
        if not queryset.query.order_by:
            queryset = queryset.order_by()
        sql, part_params = queryset.values("pk")[:limit].query.sql_with_params()
        parts.append(f"({sql})")
        params.extend(part_params)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM (SELECT 1 FROM ({' UNION ALL '.join(parts)}) AS parts "
                       f"LIMIT %s) AS bounded", [*params, limit])
        return int(cursor.fetchone()[0])
