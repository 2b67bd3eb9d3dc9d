"""``core.services.row_lock``: the one way services lock a row by its key."""

import pytest
from django.db import transaction

from core.errors import NotFound
from core.models import Project
from core.services import row_lock

pytestmark = pytest.mark.django_db


def test_row_lock_returns_the_row_with_its_related_rows_joined(project, django_assert_num_queries):
    with transaction.atomic(), django_assert_num_queries(1):
        locked = row_lock(Project, project.pk, entity="project", related=("organization",))
        assert (locked.pk, locked.organization.pk) == (project.pk, project.organization_id)


@pytest.mark.parametrize("key", [987654, "not-a-number", None])
def test_a_missing_row_or_a_malformed_key_is_not_found_named_after_the_entity(key):
    with transaction.atomic(), pytest.raises(NotFound) as raised:
        row_lock(Project, key, entity="project")
    assert raised.value.as_dict() == {"code": "not_found", "detail": f"project {key} does not exist"}
