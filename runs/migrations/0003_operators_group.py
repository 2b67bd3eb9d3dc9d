"""The "Operators" group: every runbook permission, and the view permission on every model of
our apps (``core.view_event`` among them, which lets the live socket show staff everything).

Permissions are created by ``post_migrate``, after all migrations; on a fresh database they
do not exist yet here, so they are created first (the same, idempotent, function Django uses).
"""

from django.contrib.auth.management import create_permissions
from django.db import migrations
from django.db.models import Q

OPERATORS = "Operators"
RUNBOOK_PERMISSIONS = [
    ("runs", "force_fail_run"),
    ("runs", "cancel_run"),
    ("runs", "pause_run"),
    ("runs", "resume_run"),
    ("runs", "retry_run"),
    ("runs", "escalate_run"),
    ("runs", "recover_run"),
    ("runs", "approve_gate"),
    ("runs", "manage_escalation"),
    ("billing", "refund_run"),
    ("jobs", "requeue_job"),
    ("jobs", "fail_job"),
    ("jobs", "cancel_job"),
]
VIEW_APPS = ("core", "billing", "jobs", "runs")


def operators_create(apps, schema_editor):
    for app_config in apps.get_app_configs():
        models_module = getattr(app_config, "models_module", None)
        app_config.models_module = True  # historical app configs have none; create_permissions skips those
        try:
            create_permissions(app_config, verbosity=0, apps=apps, using=schema_editor.connection.alias)
        finally:
            app_config.models_module = models_module
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    wanted = Q(content_type__app_label__in=VIEW_APPS, codename__startswith="view_")
    for app_label, codename in RUNBOOK_PERMISSIONS:
        wanted |= Q(content_type__app_label=app_label, codename=codename)
    group, _ = Group.objects.using(schema_editor.connection.alias).get_or_create(name=OPERATORS)
    group.permissions.add(*Permission.objects.using(schema_editor.connection.alias).filter(wanted))


def operators_delete(apps, schema_editor):
    apps.get_model("auth", "Group").objects.using(schema_editor.connection.alias).filter(name=OPERATORS).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("core", "0003_idempotency_record"),
        ("billing", "0002_ledger_append_only_trigger"),
        ("jobs", "0003_execution_commands_worker_sessions"),
        ("runs", "0002_approvalrequest_escalationticket"),
    ]

    operations = [migrations.RunPython(operators_create, operators_delete)]
