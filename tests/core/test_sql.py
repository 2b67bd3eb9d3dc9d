"""``core.sql``'s hand-written statements' helpers: the values a hot write sends to the database."""

from __future__ import annotations

from datetime import datetime, timezone as dt_timezone

import pytest
from django.db import connection
from django.utils import timezone

from billing.models import CreditAccount, LedgerEntry
from core.sql import db_values
from jobs.models import CommandRecord, Job
from runs.models import Agent, Run, RunAttempt, Step, StepAttempt, Task

HOT_MODELS = (Run, RunAttempt, Agent, Task, Step, StepAttempt, Job, CommandRecord, LedgerEntry, CreditAccount)


def _samples(field) -> list:
    """Values of the Python types a field is given in the services, and some it should not shortcut."""
    internal = field.get_internal_type()
    if internal in ("CharField", "TextField"):
        return ["text", "", None, 5]
    if internal == "BooleanField":
        return [True, False, None, 1]
    if internal == "DateTimeField":
        return [timezone.now(), datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt_timezone.utc), None]
    if internal == "JSONField":
        return [{"a": [1, 2]}, [], "text", None]
    if "Integer" in internal or "AutoField" in internal or internal == "ForeignKey":
        return [0, 7, 2**40, None, "12", True]
    return [None]


@pytest.mark.django_db
@pytest.mark.parametrize("model", HOT_MODELS, ids=lambda model: model.__name__)
def test_db_values_sends_what_get_db_prep_save_would_for_every_field_of_the_hot_models(model):
    connection.ensure_connection()
    for field in model._meta.concrete_fields:
        for value in _samples(field):
            try:
                expected = field.get_db_prep_save(value, connection)
            except (TypeError, ValueError):
                continue  # a value the field refuses: nothing to compare
            got = db_values([field], [value], connection)[0]
            assert type(got) is type(expected), (model.__name__, field.name, value)
            assert str(got) == str(expected), (model.__name__, field.name, value)


@pytest.mark.django_db
def test_timestamps_read_back_as_djangos_loader_reads_them():
    """The session's ``timestamptz`` text parsed by the fast loader gives what Django's own loader
    gives; a value only Django's handles (before year 1, infinity) gets Django's answer or error."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's timestamptz loader")
    from django.db import DataError
    from django.db.backends.postgresql.psycopg_any import BaseTzLoader

    class DjangoLoader(BaseTzLoader):
        timezone = connection.timezone

    texts = ["2026-11-27 17:52:22.123456+00", "2026-01-01 00:00:00+00", "2026-06-30 23:59:59.5+00",
             "0001-01-01 00:00:00+00", "9999-12-31 23:59:59.999999+00"]
    with connection.cursor() as cursor:
        assert cursor.cursor.adapters.get_loader(1184, 0).__name__ == "IsoTzLoader"
        cursor.execute("SELECT " + ", ".join(["%s::timestamptz"] * len(texts)), texts)
        fast = cursor.fetchone()
        expected = tuple(DjangoLoader(1184, cursor.cursor).load(text.encode()) for text in texts)
        assert fast == expected and all(value.tzinfo is connection.timezone for value in fast)
        for refused in ("0001-01-01 00:00:00+00 BC", "infinity"):
            cursor.execute("SELECT %s::timestamptz", [refused])
            with pytest.raises(DataError):
                cursor.fetchone()


@pytest.mark.django_db
def test_a_long_hot_statement_with_many_parameters_reads_its_values_on_every_call():
    """The hot cursor keeps the conversion of statements psycopg converts on every call (longer than
    4,096 characters, more than 50 parameters): each call still sends its own values."""
    from core.sql import hot_cursor

    sql = "SELECT " + ", ".join(f"%s + 0 AS c{index}" for index in range(60)) + " -- " + "x" * 4200
    for shift in (0, 1, 2):
        values = [index * 7 + shift for index in range(60)]
        with hot_cursor() as cursor:
            cursor.execute(sql, values)
            assert list(cursor.fetchone()) == values


@pytest.mark.django_db
def test_hot_cursors_opened_inside_one_another_each_read_their_own_rows():
    """The connection's hot cursor is lent again once closed; one asked for while it is lent (a
    statement inside another's block) is another cursor, and neither reads the other's rows."""
    from core.sql import hot_cursor

    for round_ in range(2):
        with hot_cursor() as outer:
            outer.execute("SELECT %s + 0", [10 + round_])
            with hot_cursor() as inner:
                inner.execute("SELECT %s + 0", [20 + round_])
                assert inner.fetchone()[0] == 20 + round_
            assert outer.fetchone()[0] == 10 + round_
