"""The retention prune moved to the console app: its django-q2 schedule names ``console.retention``."""

from django.db import migrations

NAME = "orchestrator-retention"


def point_to_console(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    Schedule.objects.update_or_create(
        name=NAME,
        defaults={"func": "console.retention.retention_prune_scheduled", "schedule_type": "I", "minutes": 10,
                  "repeats": -1},
    )


def point_to_core(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    Schedule.objects.filter(name=NAME).update(func="core.retention.retention_prune_scheduled")


class Migration(migrations.Migration):
    dependencies = [("core", "0005_retention_schedule"), ("django_q", "0018_task_success_index")]

    operations = [migrations.RunPython(point_to_console, point_to_core)]
