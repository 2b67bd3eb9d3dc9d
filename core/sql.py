"""Reads that take several querysets in one statement: a row of subqueries, a bounded count of a union."""

from __future__ import annotations

from typing import Any

from django.db import connections
from django.db.models import QuerySet


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
