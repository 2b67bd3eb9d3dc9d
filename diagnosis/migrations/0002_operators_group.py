"""The "Operators" group may ask for suggestions and read explanations and suggestions."""

from django.contrib.auth.management import create_permissions
from django.db import migrations

PERMISSIONS = ["request_suggestion", "view_explanation", "view_suggestion"]


def operators_grant(apps, schema_editor):
    alias = schema_editor.connection.alias
    config = apps.get_app_config("diagnosis")
    models_module, config.models_module = getattr(config, "models_module", None), True
    try:  # post_migrate creates permissions only after every migration: create them here
        create_permissions(config, verbosity=0, apps=apps, using=alias)
    finally:
        config.models_module = models_module
    group = apps.get_model("auth", "Group").objects.using(alias).filter(name="Operators").first()
    if group is not None:
        group.permissions.add(*apps.get_model("auth", "Permission").objects.using(alias).filter(
            content_type__app_label="diagnosis", codename__in=PERMISSIONS))


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("diagnosis", "0001_initial"),
        ("runs", "0003_operators_group"),
    ]

    operations = [migrations.RunPython(operators_grant, migrations.RunPython.noop)]
