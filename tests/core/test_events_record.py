"""``events_record``: several outbox rows in one statement, in the order given."""

import pytest
from django.db import transaction

from core.models import Event
from core.services import event_record, events_record


@pytest.mark.django_db
def test_rows_are_written_in_order_with_increasing_ids(django_assert_num_queries):
    first = event_record(type="before", organization_id=None)
    with django_assert_num_queries(1):
        events_record([
            {"type": "a", "organization_id": None, "run_id": 7, "payload": {"n": 1}},
            {"type": "b", "organization_id": None, "payload": {"n": 2}},
            {"type": "c", "organization_id": None},
        ])
    rows = list(Event.objects.filter(pk__gt=first.pk).order_by("id"))
    assert [row.type for row in rows] == ["a", "b", "c"]
    assert rows[0].run_id == 7 and rows[0].payload == {"n": 1} and rows[2].payload == {}
    assert all(row.created_at is not None for row in rows)


@pytest.mark.django_db
def test_nothing_is_written_for_no_rows_or_a_rolled_back_transaction(django_assert_num_queries):
    with django_assert_num_queries(0):
        events_record([])
    before = Event.objects.count()
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            events_record([{"type": "x", "organization_id": None}])
            raise RuntimeError
    assert Event.objects.count() == before


@pytest.mark.postgres
@pytest.mark.django_db
def test_a_prepared_batch_insert_keeps_its_text_in_the_query_log():
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    threshold = connection.connection.prepare_threshold or 0
    with CaptureQueriesContext(connection) as captured:
        for n in range(threshold + 2):  # the last ones run prepared
            events_record([{"type": "t", "organization_id": None, "payload": {"n": n}}])
    texts = [query["sql"] for query in captured.captured_queries]
    assert len(texts) == threshold + 2
    assert all(text and text.startswith("INSERT INTO core_event") for text in texts)
