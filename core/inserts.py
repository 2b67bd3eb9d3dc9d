"""New rows of several models in one statement, each level's rows pointing at the previous level's
(``insert_tree``): a run's agents, tasks and steps; a batch of jobs."""

from __future__ import annotations

import json
import math
from datetime import datetime
from decimal import Decimal
from operator import attrgetter

from django.db import connection, models
from psycopg.types.json import Jsonb

from core.sql import db, db_column, db_values, hot_cursor, per_vendor, sqlite_writes


def insert_tree(levels: list[tuple[list, str | None]]) -> None:
    """Insert new rows of several models, each level's rows pointing at the previous level's new rows:
    ``levels`` is ``[(rows, parent), ...]`` where ``parent`` names the foreign key through which each
    row of the level points at a row of the level before (the instance itself, set on the row: its
    key is not known yet), None for the first level. Every row gets its primary key.

    On PostgreSQL one prepared statement whatever the numbers of rows: each level one ``INSERT ...
    SELECT`` from its rows, its rows numbered in order and matched to the previous level's new keys,
    which increase in the order the rows were given (as ``bulk_create`` relies on). A level's rows
    go as one JSON text (``_json_rows``: the driver dumps one string, where an array per column
    cost it a Python call per value), parsed once by the server (``jsonb``), and each column is cast
    from its element's text as an array of that column's type was; a level holding a value with no
    exact JSON text (a date, a UUID, an infinite float...) goes as an array per column instead.
    Elsewhere one ``bulk_create`` per level. Fields are written as ``save`` writes them
    (``pre_save``); no signal is sent."""
    levels = [(rows, parent) for rows, parent in levels if rows]
    if not levels:
        return
    conn = db()
    if conn.vendor == "sqlite" and len(levels) > 1 and conn.in_atomic_block:
        _insert_tree_keyed(levels)
        return
    if conn.vendor != "postgresql":
        for rows, _ in levels:  # bulk_create takes each parent's key, known by then
            type(rows[0]).objects.bulk_create(rows)
        return
    shape, params = [], []
    previous: dict[int, int] = {}
    for rows, parent in levels:
        model = type(rows[0])
        columns = _tree_columns(model, parent)
        values = [db_column(field, _saved(field, rows), conn) for field in columns]
        parents = [previous[id(getattr(row, parent))] for row in rows] if parent is not None else None
        text = _json_rows(values, parents)
        shape.append((model, parent, text is not None))
        if text is not None:
            params.append(text)
        else:
            params.extend(values)
            if parents is not None:
                params.append(parents)
        previous = {id(row): position for position, row in enumerate(rows, start=1)}
    with hot_cursor() as cursor:
        cursor.execute(_insert_tree_sql(tuple(shape)), params)
        keys = cursor.fetchall()
    by_level: dict[int, list[int]] = {}
    for level, key in keys:
        by_level.setdefault(level, []).append(key)
    for index, (rows, parent) in enumerate(levels):
        new_keys = sorted(by_level.get(index, []))
        if len(new_keys) != len(rows):
            raise RuntimeError(f"insert_tree: {len(rows)} rows of level {index} given, {len(new_keys)} inserted")
        for row, key in zip(rows, new_keys):
            row.pk = key
            row._state.adding, row._state.db = False, conn.alias
            if parent is not None:
                setattr(row, parent, getattr(row, parent))  # sets the foreign key's column from the parent


# The ``pre_save`` of the fields that may set the time themselves (``auto_now``, ``auto_now_add``).
_AUTO_NOW_PRE_SAVES = (models.DateField.pre_save, models.DateTimeField.pre_save, models.TimeField.pre_save)


def _saved(field, rows: list) -> list:
    """``field.pre_save(row, True)`` of each row: for a field whose ``pre_save`` only reads the
    attribute (``Field``'s own, or a date or time field's without ``auto_now``/``auto_now_add``) the
    attribute read directly, without a call per row."""
    method = type(field).pre_save
    if method is models.Field.pre_save or (method in _AUTO_NOW_PRE_SAVES and not field.auto_now
                                           and not field.auto_now_add):
        return list(map(attrgetter(field.attname), rows))
    return [field.pre_save(row, True) for row in rows]


# JSON writes these as the driver would: a string's characters, an integer's digits (a subclass of
# either, such as a choice of a ``TextChoices``, the driver's ``Int4``, a boolean, by the value it holds).
_JSON_AS_IS = (str, int, type(None))


def _json_rows(columns: list[list], parents: list[int] | None) -> str | None:
    """A level's rows as one JSON array of rows (each its columns' values in order, then its parent's
    position), every value one whose text the column's cast reads back exactly: text, integers,
    booleans and null as they are (``_JSON_AS_IS``), a finite float as its shortest exact text
    (``repr``, which PostgreSQL reads back to the same double), a finite decimal as its text, an
    aware datetime as ISO 8601, a JSON value (psycopg's ``Jsonb``, as Django hands it over) as the text its own
    encoder makes. None where a value is of another type, or a float or decimal is not finite (the
    caller sends the level as arrays)."""
    texts = []
    for values in columns:
        if all(isinstance(value, _JSON_AS_IS) for value in values):
            texts.append(values)
            continue
        column = []
        for value in values:
            kind = type(value)
            if isinstance(value, _JSON_AS_IS):
                column.append(value)
            elif kind is datetime and value.tzinfo is not None:
                column.append(value.isoformat())
            elif kind is Jsonb:
                text = (value.dumps or json.dumps)(value.obj)
                column.append(text.decode() if isinstance(text, (bytes, bytearray)) else text)
            elif kind is float and math.isfinite(value):
                column.append(value)
            elif kind is Decimal and value.is_finite():
                column.append(str(value))
            else:
                return None
        texts.append(column)
    if parents is not None:
        texts.append(parents)
    return json.dumps(list(zip(*texts)), ensure_ascii=False, separators=(",", ":"))


def _insert_tree_keyed(levels: list[tuple[list, str | None]]) -> None:
    """``insert_tree`` on SQLite inside a transaction: the keys the rows will get are read first (one
    ``SELECT``: past the largest ever given, as ``AUTOINCREMENT`` gives them), then every level is
    inserted with its keys by one statement (``sqlite_writes``). The transaction holds the database's
    write lock (``BEGIN IMMEDIATE``), so no other writer takes those keys meanwhile; under another
    mode the insert of a key taken fails on the primary key rather than writing a wrong tree."""
    conn = db()
    with hot_cursor() as cursor:
        cursor.execute(_next_keys_sql(tuple(type(rows[0]) for rows, _ in levels)))
        firsts = cursor.fetchone()
    parts = []
    for (rows, parent), first in zip(levels, firsts):
        model = type(rows[0])
        for offset, row in enumerate(rows):
            row.pk = first + offset
            if parent is not None:
                setattr(row, parent, getattr(row, parent))  # sets the foreign key's column from the parent
        fields = [field for field in model._meta.concrete_fields if not field.primary_key]
        values = [[row.pk, *db_values(fields, [field.pre_save(row, True) for field in fields], conn)] for row in rows]
        parts.append((_insert_rows_sql(model), [values], False))
    sqlite_writes(parts)
    for rows, _ in levels:
        for row in rows:
            row._state.adding, row._state.db = False, conn.alias


@per_vendor
def _next_keys_sql(models_: tuple) -> str:
    qn = connection.ops.quote_name
    firsts = [f"max(coalesce((SELECT seq FROM sqlite_sequence WHERE name = '{model._meta.db_table}'), 0),"
              f" coalesce((SELECT max({qn(model._meta.pk.column)}) FROM {qn(model._meta.db_table)}), 0)) + 1"
              for model in models_]
    return f"SELECT {', '.join(firsts)}"


@per_vendor
def _insert_rows_sql(model) -> str:
    """One row per element of a JSON array of rows (each its key, then its other columns in order)."""
    qn = connection.ops.quote_name
    meta = model._meta
    columns = [meta.pk, *(field for field in meta.concrete_fields if not field.primary_key)]
    values = ", ".join(f"json_extract(r.value, '$[{index}]')" for index in range(len(columns)))
    return (f"INSERT INTO {qn(meta.db_table)} ({', '.join(qn(field.column) for field in columns)})"
            f" SELECT {values} FROM json_each(%s) AS r ORDER BY r.key")


def _tree_columns(model, parent: str | None) -> list:
    """The fields ``insert_tree`` writes from its rows: every concrete field but the key and the parent's."""
    skip = model._meta.get_field(parent).attname if parent else None
    return [field for field in model._meta.concrete_fields if not field.primary_key and field.attname != skip]


@per_vendor
def _insert_tree_sql(shape: tuple) -> str:
    """``shape``: per level ``(model, parent, as_json)``; a level as JSON takes one parameter (its rows,
    each element ``e`` read as ``(e->>n)::type``, as an element of an array of that type is read), a
    level as arrays one per column (``unnest``), a level with a parent one more for its positions."""
    conn = db()
    qn = conn.ops.quote_name
    parts, selects = [], []
    for index, (model, parent, as_json) in enumerate(shape):
        columns = _tree_columns(model, parent)
        names = [qn(field.column) for field in columns]
        if as_json:
            values = [f"(u.e->>{n})::{field.cast_db_type(conn)}" for n, field in enumerate(columns)]
            rows = "jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS u(e, o)"
            position = f"(u.e->>{len(columns)})::int"
        else:
            aliases = [f"c{n}" for n in range(len(columns))]
            values = [f"u.{alias}" for alias in aliases]
            arrays = [f"%s::{field.cast_db_type(conn)}[]" for field in columns]
            if parent is not None:
                arrays.append("%s::int[]")
                aliases.append("parent")
            rows = f"unnest({', '.join(arrays)}) WITH ORDINALITY AS u({', '.join(aliases)}, o)"
            position = "u.parent"
        if parent is None:
            source = f"SELECT {', '.join(values)} FROM {rows} ORDER BY u.o"
            target = ", ".join(names)
        else:
            source = (f"SELECT {', '.join(values)}, p.id FROM {rows} JOIN n{index - 1} p ON p.n = {position}"
                      " ORDER BY u.o")
            target = ", ".join([*names, qn(model._meta.get_field(parent).column)])
        parts.append(f"i{index} AS (INSERT INTO {qn(model._meta.db_table)} ({target}) {source}"
                     f" RETURNING {qn(model._meta.pk.column)} AS id)")
        if index < len(shape) - 1:
            parts.append(f"n{index} AS (SELECT id, ROW_NUMBER() OVER (ORDER BY id) AS n FROM i{index})")
        selects.append(f"SELECT {index}, id FROM i{index}")
    return f"WITH {', '.join(parts)} {' UNION ALL '.join(selects)}"
