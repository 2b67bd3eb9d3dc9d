"""The django-q2 schedule that runs the retention prune every 10 minutes (``core.retention``)."""

from django.db import migrations


def create_schedule(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    Schedule.objects.update_or_create(
        name="orchestrator-retention",
        defaults={"func": "core.retention.retention_prune_scheduled", "schedule_type": "I", "minutes": 10,
                  "repeats": -1},
    )


def delete_schedule(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    Schedule.objects.filter(name="orchestrator-retention").delete()


class Migration(migrations.Migration):
    dependencies = [("core", "0004_observability_retention"), ("django_q", "0018_task_success_index")]

    operations = [migrations.RunPython(create_schedule, delete_schedule)]
