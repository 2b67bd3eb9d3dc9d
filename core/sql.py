"""Hand-written SQL the ORM would build on every call: reads that take several querysets in one
statement (a row of subqueries, a bounded count of a union), the cursor the hot statements run on,
and model rows read by statements written once."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterator

from django.db import DEFAULT_DB_ALIAS, IntegrityError, OperationalError, connection, connections, models
from django.db.models import Model, QuerySet
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init
from django_fsm import ConcurrentTransitionMixin, FSMFieldMixin


def db():
    """This thread's default connection itself, not the ``django.db.connection`` proxy, which looks
    the connection up again on every attribute read: hot paths read it once. Kept per thread for the
    life of the handler's per-thread storage (code that puts another connection object in its place,
    ``connections["default"] = ...``, is not followed: nothing here does)."""
    kept = getattr(_db, "kept", None)
    handler_connections = connections._connections
    if kept is not None and kept[0] is handler_connections:
        return kept[1]
    conn = connections[DEFAULT_DB_ALIAS]
    _db.kept = (handler_connections, conn)
    return conn


_db = threading.local()


# Fields whose ``get_db_prep_save`` hands a value of the usual type to the driver as it is, or (an
# integer on PostgreSQL) wrapped in the driver's type of that column: text, booleans, integers (and
# a foreign key to an integer key), aware datetimes on PostgreSQL. ``db_values`` skips the call for
# them and does the same.
_PLAIN_FIELDS = (models.AutoField, models.BigAutoField, models.SmallAutoField, models.IntegerField,
                 models.BigIntegerField, models.SmallIntegerField, models.PositiveIntegerField,
                 models.PositiveBigIntegerField, models.PositiveSmallIntegerField, models.CharField,
                 models.TextField, models.BooleanField)
_TEXT_FIELDS = (models.CharField, models.TextField)


def _field_kind(field, conn) -> tuple:
    """``(type, wrap)``: a value of exactly ``type`` goes to the driver as ``wrap(value)`` (as it is
    when ``wrap`` is None); ``(None, None)``: always through ``get_db_prep_save``."""
    kinds = field.__dict__.get("_db_values_kinds")  # on the field: its own hash is computed at every call
    if kinds is None:
        kinds = field.__dict__["_db_values_kinds"] = {}
    kind = kinds.get(conn.vendor)
    if kind is None:
        target = field.target_field if type(field) is models.ForeignKey else field
        cls = type(target)
        fsm = type(field).__module__ == "django_fsm" and isinstance(field, models.CharField)
        if fsm or (cls in _TEXT_FIELDS and type(field) in (*_PLAIN_FIELDS, models.ForeignKey)):
            kind = (str, None)
        elif cls is models.BooleanField and type(field) is cls:
            kind = (bool, None)
        elif cls in _PLAIN_FIELDS and type(field) in (*_PLAIN_FIELDS, models.ForeignKey):
            wrap = getattr(conn.ops, "integerfield_type_map", {}).get(target.get_internal_type()) \
                if hasattr(conn.ops, "adapt_integerfield_value") and conn.vendor == "postgresql" else None
            kind = (int, wrap)
        elif type(field) is models.DateTimeField and conn.vendor == "postgresql":
            kind = (datetime, None)
        else:
            kind = (None, None)
        kinds[conn.vendor] = kind
    return kind


def db_values(fields, values, conn) -> list:
    """``[field.get_db_prep_save(value, conn) ...]`` of ``fields`` and their ``values``, without the
    call where it would hand the value over as it is or wrapped (``_field_kind``); None as it is
    where the field takes it so: hot writes prepare a few dozen values per statement."""
    out = []
    for field, value in zip(fields, values):
        expected, wrap = _field_kind(field, conn)
        if type(value) is expected and (expected is not datetime or value.tzinfo is not None):
            out.append(value if wrap is None else wrap(value))
        elif value is None and expected is not None:
            out.append(None)
        else:
            out.append(field.get_db_prep_save(value, conn))
    return out


def db_column(field, values, conn) -> list:
    """``db_values`` of one field's ``values`` (a column of several rows): the field's kind looked up
    once for the column, not once per value."""
    expected, wrap = _field_kind(field, conn)
    if expected is None:
        return [field.get_db_prep_save(value, conn) for value in values]
    out = []
    for value in values:
        if type(value) is expected and (expected is not datetime or value.tzinfo is not None):
            out.append(value if wrap is None else wrap(value))
        elif value is None:
            out.append(None)
        else:
            out.append(field.get_db_prep_save(value, conn))
    return out


def per_vendor(build):
    """``build(*args)`` (an SQL text built from the connection's vendor, quoting, features) called once
    per vendor and arguments, then served from memory: a hot statement's text is written once."""
    built: dict[tuple, Any] = {}

    def cached(*args):
        key = (db().vendor, *args)
        if key not in built:
            built[key] = build(*args)
        return built[key]

    cached.__name__, cached.__doc__ = build.__name__, build.__doc__
    return cached


def hot_cursor():
    """A cursor for hot statements (raw SQL built once per process). On PostgreSQL it binds
    parameters on the server, so psycopg prepares a statement once it ran ``prepare_threshold``
    times on the connection (parsed and planned once, not per call); it goes through Django's
    cursor wrapper all the same (execute wrappers, query logging).

    On PostgreSQL the connection's driver cursor is used again from one call to the next (closing it
    only hands it back): a new one would look up its parameters' dumpers and its columns' loaders
    again for every statement, about a third of the driver's time per statement. A call made while
    it is handed out (a statement inside another's block, an execute wrapper's) gets a cursor of its
    own, as does any call on a connection opened since."""
    conn = db()
    conn.ensure_connection()
    if conn.vendor != "postgresql":
        return conn.cursor()
    raw = conn.connection
    kept = conn.__dict__.get("_hot_cursor")
    if kept is None or kept.connection is not raw:
        kept = _hot_cursor_class()(raw)
        kept.kept = True
        conn.__dict__["_hot_cursor"] = kept
    if kept.lent:
        return conn._prepare_cursor(_hot_cursor_class()(raw))
    kept.lent = True
    return conn._prepare_cursor(kept)


@contextlib.contextmanager
def prepared_at_once(raw) -> Iterator[None]:
    """Statements sent on psycopg connection ``raw`` in the block are prepared on their first run, not
    after ``prepare_threshold`` runs (each planned anew until then; unless ``raw`` prepares nothing)."""
    threshold, raw.prepare_threshold = raw.prepare_threshold, 0 if raw.prepare_threshold is not None else None
    try:
        yield
    finally:
        raw.prepare_threshold = threshold


# Where a row's object stands against the database, for callers that keep objects from one
# transaction to the next: under ``ROW_VERSION`` (a key of the object's ``__dict__``) the version
# it was read in (PostgreSQL's ``xmin``, put there by the caller's read), or ``ROW_WRITTEN`` once a
# transaction of this connection wrote its fields as they are (``core.fsm.moves_written``): that
# transaction's id, which the caller knows, is then its version.
ROW_VERSION = "_row_version"
ROW_WRITTEN = "written"


_HOT_CURSOR: list[type] = []


def _hot_cursor_class() -> type:
    """psycopg's server-binding cursor that keeps the statement it sent once prepared too, so
    Django's query log (``connection.queries``, the test client's captured queries) shows its text
    rather than ``None`` (psycopg records the query only when it sends it unprepared)."""
    if not _HOT_CURSOR:
        from django.db.backends.postgresql.base import ServerBindingCursor
        from psycopg._queries import PostgresQuery, _query2pg_nocache

        # psycopg converts a statement's text (``%s`` to ``$n``) once per distinct text, but not one
        # longer than 4,096 characters or with more than 50 parameters, which it converts on every
        # call: those limits guard its cache against the endless texts an ORM builds. The hot
        # statements are few, written once per process, and the longest of them (a settlement's
        # ``WITH``, a run's tree) are the most called: their conversions are kept, 256 at most.
        converted = lru_cache(maxsize=256)(_query2pg_nocache)

        class HotQuery(PostgresQuery):
            __slots__ = ()

            def convert(self, query, vars):
                if vars is None or not isinstance(query, (str, bytes)):
                    return super().convert(query, vars)
                self.query, self._want_formats, self._order, self._parts = converted(
                    self._ensure_bytes(query), self._tx.encoding)
                self.dump(vars)

        class HotCursor(ServerBindingCursor):
            _query_cls = HotQuery
            kept = False  # the connection's cursor that ``hot_cursor`` lends again and again
            lent = False  # handed out, not closed yet

            def close(self):
                if self.kept:
                    self.lent = False  # back to its connection, for the next call
                    return
                super().close()

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
        self._plain_model: bool | None = None
        self._states: list[tuple[str, int]] | None = None

    def columns(self, alias: str) -> str:
        qn = connection.ops.quote_name
        return ", ".join(f"{alias}.{qn(field.column)}" for field in self.fields)

    def _converters_now(self, connection) -> list:
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

    def load(self, row, start: int = 0, conn=None):
        """The instance whose values are ``row[start:start + width]`` (``conn``: the connection they
        were read on, when the caller holds it)."""
        conn = conn or db()
        values = list(row[start:start + self.width])
        for index, expression, functions in self._converters_now(conn):
            value = values[index]
            for function in functions:
                value = function(value, expression, conn)
            values[index] = value
        if not self.plain():
            return self.model.from_db(conn.alias, self.names, values)
        # What ``from_db`` builds, without the field-by-field ``__init__`` (a run's tree loads dozens of
        # rows per transaction): every concrete field's value, the state of a row read from ``conn``.
        instance = self.model.__new__(self.model)
        instance.__dict__.update(zip(self.names, values))
        instance._state = ModelState()
        instance._state.adding, instance._state.db = False, conn.alias
        if self._states is not None:  # ``ConcurrentTransitionMixin._update_initial_state``, from the values
            instance._ConcurrentTransitionMixin__initial_states = {name: values[index] for name, index in self._states}
        return instance

    def plain(self) -> bool:
        """Whether ``Model.from_db`` would do nothing but set the fields: the model keeps Django's own
        ``from_db`` and ``__init__`` (the state machines' mixin adds only its initial states) and
        nothing listens to its ``pre_init``/``post_init`` signals."""
        if self._plain_model is None:
            model = self.model
            self._plain_model = (model.from_db.__func__ is Model.from_db.__func__
                                 and all(klass.__dict__.get("__init__") is None
                                         for klass in model.__mro__
                                         if klass not in (Model, ConcurrentTransitionMixin, object)))
            if issubclass(model, ConcurrentTransitionMixin):  # its state fields' positions in a row
                states = [field.attname for field in model._meta.concrete_fields
                          if isinstance(field, FSMFieldMixin)]
                self._states = [(name, self.names.index(name)) for name in states]
        if not self._plain_model:
            return False
        # No receiver at all (the usual case) answers at once; else ask for this model's.
        return ((not pre_init.receivers or not pre_init.has_listeners(self.model))
                and (not post_init.receivers or not post_init.has_listeners(self.model)))


def insert_returning(instance, returning: str = "", params: list | tuple = (), *, with_: str = "") -> Any:
    """Insert the new ``instance`` (its fields as ``save`` writes them: ``pre_save`` fills ``auto_now``
    and the like) by one prepared statement built once per model and ``returning`` (an SQL expression
    read in the same statement, ``params`` its parameters; none by default); the instance gets its
    primary key, and the expression's value is returned. No ``pre_save`` or ``post_save`` signal is
    sent: for rows nothing listens to, written where ``Model.objects.create`` would compile the
    same ``INSERT`` on every call. ``with_``: a ``WITH`` clause put before the ``INSERT`` (its
    parameters first in ``params``, which then go before the row's values); ``returning`` may
    read its parts (``core.fsm.save_moved_together``)."""
    model, conn = type(instance), db()
    fields = [field for field in model._meta.concrete_fields if not field.primary_key]
    values = db_values(fields, [field.pre_save(instance, True) for field in fields], conn)
    with hot_cursor() as cursor:
        cursor.execute(_insert_returning_sql(model, returning, with_),
                       [*params, *values] if with_ else [*values, *params])
        row = cursor.fetchone()
    instance.pk = row[0]
    instance._state.adding, instance._state.db = False, conn.alias
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


# --- several writes in one statement on SQLite --------------------------------------------------

_WRITE_MISSED = "orchestrator: no row for write "


class WriteMissed(Exception):
    """A guarded write of ``sqlite_writes`` changed no row, or more than one (``index``: its place in
    the parts): the statement was undone as a whole, the transaction goes on."""

    def __init__(self, index: int) -> None:
        super().__init__(f"write {index} of the statement changed no row")
        self.index = index


def sqlite_writes(parts: list[tuple[str, list, bool]]) -> None:
    """Several writes in one statement on SQLite, where PostgreSQL puts them in one ``WITH``: ``parts``
    are ``(sql, params, guarded)``, each an ``INSERT``, ``UPDATE`` or ``DELETE`` with ``%s``
    placeholders, made in order; ``guarded``: it must change exactly one row, else the statement
    is undone as a whole and ``WriteMissed`` names it.

    The statement inserts one row, every part's parameters as one JSON array, into a temporary view
    whose ``INSTEAD OF`` trigger makes the writes (each placeholder reads its element of the array);
    the view is made on the connection (two ``CREATE TEMP`` statements) the first time its shape is
    written, and again after a rollback of the transaction that made it took it away. Parameters
    travel as JSON: text, numbers, None and booleans as they are, anything else as its text (the
    values the driver gets from ``get_db_prep_save`` are of those kinds)."""
    name, body, heads = _writes_view(tuple((sql, guarded) for sql, _, guarded in parts))
    document = json.dumps([param for _, params, _ in parts for param in params], default=_json_param,
                          separators=(",", ":"))
    conn = db()
    conn.ensure_connection()
    made = _views_made(conn)
    sql = f"INSERT INTO temp.{name} (p) VALUES (%s) /* {heads} */"
    with conn.cursor() as cursor:
        if name not in made:
            _view_make(cursor, name, body)
            made.add(name)
        for again in (False, True):
            try:
                cursor.execute(sql, [document])
                return
            except OperationalError as exc:
                if again or name not in str(exc):  # else a rollback took the view away with the transaction
                    raise                          # that made it
                _view_make(cursor, name, body)
            except IntegrityError as exc:
                _raise_missed(exc)


def _json_param(value) -> str:
    """A parameter JSON has no type for: its text (a decimal, a key), never bytes."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError("sqlite_writes: a binary parameter has no JSON form")
    return str(value)


def _views_made(conn) -> set:
    """The names of the views made on ``conn``'s current database connection."""
    made = getattr(conn, "_orchestrator_views", None)
    if made is None or made[0] is not conn.connection:
        made = conn._orchestrator_views = (conn.connection, set())
    return made[1]


def _view_make(cursor, name: str, body: str) -> None:
    cursor.execute(f"CREATE TEMP VIEW IF NOT EXISTS {name} (p) AS SELECT NULL")
    cursor.execute(f"CREATE TEMP TRIGGER IF NOT EXISTS {name}_w INSTEAD OF INSERT ON {name} BEGIN {body} END")


def _raise_missed(exc: IntegrityError) -> None:
    text = str(exc)
    if text.startswith(_WRITE_MISSED):
        raise WriteMissed(int(text[len(_WRITE_MISSED):])) from exc
    raise exc


_WRITES_VIEWS: dict[tuple, tuple[str, str, str]] = {}
_WRITE_HEAD = re.compile(r"\s*(INSERT INTO|UPDATE|DELETE FROM)\s+(\S+)", re.IGNORECASE)


def _writes_view(shape: tuple[tuple[str, bool], ...]) -> tuple[str, str, str]:
    """The name of the view that writes ``shape`` (named by its text's digest: the same on every
    connection), its trigger's body, and the writes' heads (``UPDATE "runs_step"``, ...) for the
    statement's comment: the query log shows what it writes."""
    found = _WRITES_VIEWS.get(shape)
    if found is None:
        statements, position = [], 0
        for index, (sql, guarded) in enumerate(shape):
            pieces = sql.split("%s")
            text = pieces[0]
            for piece in pieces[1:]:
                text += f"json_extract(NEW.p, '$[{position}]'){piece}"
                position += 1
            statements.append(f"{text};")
            if guarded:
                statements.append(f"SELECT RAISE(ABORT, '{_WRITE_MISSED}{index}') WHERE changes() <> 1;")
        body = " ".join(statements)
        heads = ", ".join(" ".join(match.groups()) if (match := _WRITE_HEAD.match(sql)) else "?" for sql, _ in shape)
        found = _WRITES_VIEWS[shape] = (f"orchestrator_writes_{hashlib.sha1(body.encode()).hexdigest()[:20]}",
                                        body, heads.replace("*/", ""))
    return found
