"""PostgreSQL: every transaction that inserts events sends one ``NOTIFY orchestrator_events``
at commit (a statement trigger; a rolled-back transaction notifies nothing)."""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION core_event_notify() RETURNS trigger AS $$
BEGIN
    PERFORM pg_notify('orchestrator_events', '');
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS core_event_notify ON core_event;
CREATE TRIGGER core_event_notify AFTER INSERT ON core_event
    FOR EACH STATEMENT EXECUTE FUNCTION core_event_notify();
"""

DROP = """
DROP TRIGGER IF EXISTS core_event_notify ON core_event;
DROP FUNCTION IF EXISTS core_event_notify();
"""


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("core", "0001_initial")]

    operations = [migrations.RunPython(forwards, backwards)]
