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
