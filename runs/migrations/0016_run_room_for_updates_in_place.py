from django.db import migrations


def fillfactor(value: int):
    def apply(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(f"ALTER TABLE runs_run SET (fillfactor = {value})")
    return apply


class Migration(migrations.Migration):
    """Room on each page of runs for the next version of its rows. A step's settlement updates its
    run's figures (credits charged, updated_at), no indexed column: PostgreSQL writes such an update
    on the same page, with no new entry in any of the run's twenty-odd indexes (a HOT update),
    only while the page has room. Pages written from now on keep a fifth free; the others get it
    as they are rewritten."""

    dependencies = [
        ('runs', '0015_run_running_silent_index_only'),
    ]

    operations = [
        migrations.RunPython(fillfactor(80), fillfactor(100), elidable=False),
    ]
