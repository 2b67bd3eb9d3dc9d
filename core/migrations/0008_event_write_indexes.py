"""Fewer index entries per event row (every state change writes one): the single-column index on
``organization`` goes (``event_org_id_idx`` leads with it), ``type`` loses its LIKE index (nothing
searches a prefix of it; the plain one is renamed, not rebuilt, on PostgreSQL), and the run index
holds only the events of a run."""

from django.db import migrations, models

OLD_ORGANIZATION = "core_event_organization_id_a2ce68e9"
OLD_TYPE, OLD_TYPE_LIKE = "core_event_type_5f348554", "core_event_type_5f348554_like"
OLD_RUN = "core_event_run_id_fce0f2d9"


def forward(apps, schema_editor):
    run = schema_editor.execute
    run(f'DROP INDEX IF EXISTS "{OLD_ORGANIZATION}"')
    run(f'DROP INDEX IF EXISTS "{OLD_TYPE_LIKE}"')
    if schema_editor.connection.vendor == "postgresql":
        run(f'ALTER INDEX IF EXISTS "{OLD_TYPE}" RENAME TO "event_type_idx"')
    else:
        run(f'DROP INDEX IF EXISTS "{OLD_TYPE}"')
    run('CREATE INDEX IF NOT EXISTS "event_type_idx" ON "core_event" ("type")')
    run('CREATE INDEX IF NOT EXISTS "event_run_idx" ON "core_event" ("run_id") WHERE "run_id" IS NOT NULL')
    run(f'DROP INDEX IF EXISTS "{OLD_RUN}"')


def backward(apps, schema_editor):
    run = schema_editor.execute
    run(f'CREATE INDEX IF NOT EXISTS "{OLD_ORGANIZATION}" ON "core_event" ("organization_id")')
    run(f'CREATE INDEX IF NOT EXISTS "{OLD_RUN}" ON "core_event" ("run_id")')
    run('DROP INDEX IF EXISTS "event_run_idx"')
    run('DROP INDEX IF EXISTS "event_type_idx"')
    run(f'CREATE INDEX IF NOT EXISTS "{OLD_TYPE}" ON "core_event" ("type")')
    if schema_editor.connection.vendor == "postgresql":
        run(f'CREATE INDEX IF NOT EXISTS "{OLD_TYPE_LIKE}" ON "core_event" ("type" varchar_pattern_ops)')


class Migration(migrations.Migration):

    dependencies = [
        ("core", "0007_bulk_operation"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="event", name="organization",
                    field=models.ForeignKey(blank=True, db_constraint=False, db_index=False, null=True,
                                            on_delete=models.deletion.DO_NOTHING, related_name="+",
                                            to="core.organization"),
                ),
                migrations.AlterField(model_name="event", name="run_id",
                                      field=models.BigIntegerField(blank=True, null=True)),
                migrations.AlterField(model_name="event", name="type", field=models.CharField(max_length=64)),
                migrations.AddIndex(model_name="event", index=models.Index(fields=["type"], name="event_type_idx")),
                migrations.AddIndex(
                    model_name="event",
                    index=models.Index(condition=models.Q(("run_id__isnull", False)), fields=["run_id"],
                                       name="event_run_idx"),
                ),
            ],
            database_operations=[migrations.RunPython(forward, backward)],
        ),
    ]
