"""Fewer index entries per job row write (a claim, a completion): the jobs outside any run are not
in the run indexes, and the jobs without a dedupe key (most) not in its unique index (NULLs never
conflicted there)."""

from django.db import migrations, models

OLD_RUN = "jobs_job_run_id_737e7f79"


def drop_old_run_index(apps, schema_editor):
    schema_editor.execute(f'DROP INDEX IF EXISTS "{OLD_RUN}"')


def create_old_run_index(apps, schema_editor):
    schema_editor.execute(f'CREATE INDEX IF NOT EXISTS "{OLD_RUN}" ON "jobs_job" ("run_id")')


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0015_job_redundant_indexes"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="job",
            index=models.Index(condition=models.Q(("run_id__isnull", False)), fields=["run_id"], name="job_run_idx"),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AlterField(model_name="job", name="run_id",
                                                    field=models.BigIntegerField(blank=True, null=True))],
            database_operations=[migrations.RunPython(drop_old_run_index, create_old_run_index)],
        ),
        migrations.RemoveConstraint(model_name="job", name="job_unique_active_dedupe_key"),
        migrations.AddConstraint(
            model_name="job",
            constraint=models.UniqueConstraint(condition=models.Q(("active_dedupe_key__isnull", False)),
                                               fields=("active_dedupe_key",), name="job_unique_active_dedupe_key"),
        ),
    ]
