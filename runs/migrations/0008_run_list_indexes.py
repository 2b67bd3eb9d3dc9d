from django.conf import settings
from django.contrib.postgres.operations import TrigramExtension
from django.db import migrations, models

# The run list's search (``icontains``: ``UPPER(col::text) LIKE UPPER('%term%')`` on PostgreSQL) on
# the name and the error code, served by trigram GIN indexes on the same expressions. PostgreSQL
# only: TrigramExtension does nothing on another engine, and the indexes are made here, outside
# the model state, because SQLite (which rebuilds a table with every index of its state when it
# alters one) cannot create a GIN index. They are written as SQL because Django renders
# ``GinIndex(OpClass(Upper(...)))`` as ``(UPPER(col) gin_trgm_ops)``, which PostgreSQL rejects.
TRIGRAM_INDEXES = {"run_name_trgm_idx": "name", "run_error_code_trgm_idx": "last_error_code"}


def trigram_indexes_add(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for name, column in TRIGRAM_INDEXES.items():
            schema_editor.execute(f'CREATE INDEX IF NOT EXISTS "{name}" ON "runs_run" '
                                  f'USING gin ((UPPER("{column}"::text)) gin_trgm_ops)')


def trigram_indexes_remove(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for name in TRIGRAM_INDEXES:
            schema_editor.execute(f'DROP INDEX IF EXISTS "{name}"')


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0007_failed_attempts_index'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        TrigramExtension(),
        migrations.RunPython(trigram_indexes_add, trigram_indexes_remove),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(fields=['status', 'id'], name='run_status_id_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(fields=['project', 'id'], name='run_project_id_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(fields=['last_error_code', 'id'], name='run_error_code_id_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('status__in', ['pending', 'running', 'paused', 'resuming', 'retrying'])), fields=['id'], name='run_live_id_idx'),
        ),
        migrations.AddIndex(
            model_name='run',
            index=models.Index(condition=models.Q(('status__in', ['completed', 'cancelled', 'failed']), _negated=True), fields=['id'], name='run_unsettled_id_idx'),
        ),
    ]
