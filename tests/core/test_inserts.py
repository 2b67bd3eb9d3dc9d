"""``core.inserts.insert_tree``: new rows in one statement, each value written as given."""

from __future__ import annotations

import math

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from core.inserts import insert_tree
from core.models import MetricDelta

TRICKY_TEXTS = ['plain', '', 'it\'s "quoted"', 'back\\slash \\u0041 and \\\\', 'new\nline\ttab',
                'ünïcode ✓ 🚀', '{"looks": "like json"}', '[1, 2]', 'null']
EXACT_FLOATS = [0.1, 0.1 + 0.2, 1e-300, 1.7976931348623157e308, -2.5, 2.0 ** 53 + 2, 0.0]


def _inserts(captured) -> list[str]:
    return [query["sql"] for query in captured.captured_queries if "INSERT" in query["sql"].upper()]


@pytest.mark.django_db
def test_rows_are_inserted_by_one_statement_and_read_back_as_given():
    rows = [MetricDelta(name=f"m{n}", labels=text, count=2 ** 62 - n, total=EXACT_FLOATS[n % len(EXACT_FLOATS)])
            for n, text in enumerate(TRICKY_TEXTS)]
    with CaptureQueriesContext(connection) as captured:
        insert_tree([(rows, None)])
    assert len(_inserts(captured)) == 1
    assert [row.pk for row in rows] == sorted(row.pk for row in rows)  # keys follow the order given
    stored = {row.pk: row for row in MetricDelta.objects.filter(pk__in=[row.pk for row in rows])}
    for row in rows:
        kept = stored[row.pk]
        assert (kept.name, kept.labels, kept.count, kept.total) == (row.name, row.labels, row.count, row.total)
        assert repr(kept.total) == repr(row.total)  # the same double, not a neighbour


@pytest.mark.django_db
@pytest.mark.skipif(connection.vendor != "postgresql", reason="SQLite stores a NaN as NULL")
def test_a_value_with_no_exact_json_text_is_written_all_the_same_in_one_statement():
    rows = [MetricDelta(name="inf", labels="a", total=math.inf), MetricDelta(name="nan", labels="b", total=math.nan),
            MetricDelta(name="plain", labels="c\"", total=0.1)]
    with CaptureQueriesContext(connection) as captured:
        insert_tree([(rows, None)])
    assert len(_inserts(captured)) == 1
    stored = {row.name: row for row in MetricDelta.objects.filter(pk__in=[row.pk for row in rows])}
    assert stored["inf"].total == math.inf and math.isnan(stored["nan"].total)
    assert (stored["plain"].labels, stored["plain"].total) == ("c\"", 0.1)
