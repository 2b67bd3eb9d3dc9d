from django.contrib.auth.management import create_permissions
from django.db import migrations

GATE_PERMISSIONS = ("acknowledge_drift", "void_run")


def operators_may_steer_gates(apps, schema_editor):
    """The Operators group gets the gated-pipeline permissions (created here: post_migrate runs later)."""
    alias = schema_editor.connection.alias
    config = apps.get_app_config("runs")
    models_module, config.models_module = getattr(config, "models_module", None), True
    try:
        create_permissions(config, verbosity=0, apps=apps, using=alias)
    finally:
        config.models_module = models_module
    group = apps.get_model("auth", "Group").objects.using(alias).filter(name="Operators").first()
    if group is not None:
        Permission = apps.get_model("auth", "Permission")
        # the view permissions of the new models too: Operators see every model of our apps
        group.permissions.add(*Permission.objects.using(alias).filter(
            content_type__app_label="runs", codename__in=[
                *GATE_PERMISSIONS, "view_phaserecord", "view_gatereceipt", "view_contextpin", "view_driftrecord",
                "view_pipelinekey"]))


def operators_forget_gates(apps, schema_editor):
    group = apps.get_model("auth", "Group").objects.using(schema_editor.connection.alias).filter(
        name="Operators").first()
    if group is not None:
        group.permissions.remove(*apps.get_model("auth", "Permission").objects.filter(
            content_type__app_label="runs", codename__in=GATE_PERMISSIONS))


class Migration(migrations.Migration):

    dependencies = [
        ('auth', '0012_alter_user_first_name_max_length'),
        ('contenttypes', '0002_remove_content_type_name'),
        ('runs', '0005_gated_pipelines'),
    ]

    operations = [
        migrations.RunPython(operators_may_steer_gates, operators_forget_gates),
    ]
