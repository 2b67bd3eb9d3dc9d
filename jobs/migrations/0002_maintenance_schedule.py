"""The django-q2 schedule that runs queue maintenance every minute (a backstop of the
workers' own heartbeat-driven maintenance)."""

from django.db import migrations


def create_schedule(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    Schedule.objects.update_or_create(
        name="orchestrator-maintenance",
        defaults={"func": "jobs.tasks.maintenance", "schedule_type": "I", "minutes": 1, "repeats": -1},
    )


def delete_schedule(apps, schema_editor):
    Schedule = apps.get_model("django_q", "Schedule")
    Schedule.objects.filter(name="orchestrator-maintenance").delete()


class Migration(migrations.Migration):
    dependencies = [("jobs", "0001_initial"), ("django_q", "0018_task_success_index")]

    operations = [migrations.RunPython(create_schedule, delete_schedule)]
