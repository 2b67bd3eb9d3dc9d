"""The job table's single-column indexes on ``organization``, ``project`` and ``type`` go: the
composite indexes ``job_organization_state_idx``, ``job_project_id_idx`` (and
``job_project_state_idx``) and ``job_type_id_idx`` lead with the same columns and serve the same
lookups, and every index costs each write of a job row (a claim, a completion) one more entry.

Only the indexes are dropped: the foreign keys stay as they are (``AlterField`` would drop and
re-add them, validating every row of the table again)."""

from django.db import migrations, models

INDEXES = [
    ("jobs_job_organization_id_7d00dcbc", "organization_id", ""),
    ("jobs_job_project_id_93355715", "project_id", ""),
    ("jobs_job_type_6a80b3ef", "type", ""),
    ("jobs_job_type_6a80b3ef_like", "type", "varchar_pattern_ops"),
]


def drop_indexes(apps, schema_editor):
    for name, _, _ in INDEXES:
        schema_editor.execute(f'DROP INDEX IF EXISTS "{name}"')


def create_indexes(apps, schema_editor):
    postgresql = schema_editor.connection.vendor == "postgresql"
    for name, column, opclass in INDEXES:
        if opclass and not postgresql:
            continue
        schema_editor.execute(f'CREATE INDEX IF NOT EXISTS "{name}" ON "jobs_job" ("{column}" {opclass})')


class Migration(migrations.Migration):

    dependencies = [
        ("core", "0007_bulk_operation"),
        ("jobs", "0014_executing_run_index"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="job",
                    name="organization",
                    field=models.ForeignKey(db_index=False, on_delete=models.deletion.PROTECT, related_name="jobs",
                                            to="core.organization"),
                ),
                migrations.AlterField(
                    model_name="job",
                    name="project",
                    field=models.ForeignKey(db_index=False, on_delete=models.deletion.PROTECT, related_name="jobs",
                                            to="core.project"),
                ),
                migrations.AlterField(
                    model_name="job",
                    name="type",
                    field=models.CharField(max_length=100),
                ),
            ],
            database_operations=[migrations.RunPython(drop_indexes, create_indexes)],
        ),
    ]
