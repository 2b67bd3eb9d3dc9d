from django.conf import settings
from django.contrib.postgres.indexes import GinIndex, OpClass
from django.contrib.postgres.operations import TrigramExtension
from django.db import migrations, models
from django.db.models.functions import Upper

# The run list's search (``icontains``: ``UPPER(col) LIKE UPPER('%term%')`` on PostgreSQL) on the
# name and the error code, served by trigram indexes on the same expressions. PostgreSQL only:
# TrigramExtension does nothing on another engine, and the indexes are made by RunPython so that
# they stay out of the model state (SQLite, which rebuilds a table with every index of its state
# when it alters one, cannot create a GIN index).
TRIGRAM_INDEXES = [
    GinIndex(OpClass(Upper("name"), name="gin_trgm_ops"), name="run_name_trgm_idx"),
    GinIndex(OpClass(Upper("last_error_code"), name="gin_trgm_ops"), name="run_error_code_trgm_idx"),
]


def trigram_indexes_add(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for index in TRIGRAM_INDEXES:
            schema_editor.add_index(apps.get_model("runs", "Run"), index)


def trigram_indexes_remove(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for index in TRIGRAM_INDEXES:
            schema_editor.remove_index(apps.get_model("runs", "Run"), index)


class Migration(migrations.Migration):

    dependencies = [
        ('core', '0005_retention_schedule'),
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
    ]
