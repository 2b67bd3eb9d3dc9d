"""Operations our migrations share (a leading underscore: not a migration itself; historical models only)."""

from __future__ import annotations

from django.contrib.auth.management import create_permissions
from django.db import migrations


def operators_view_grant(app_label: str, model_name: str) -> migrations.RunPython:
    """The Operators group views every model of our apps: give it the view permission of a model a
    migration adds (created here: post_migrate runs later). A group made later by runs/0003 takes
    every view permission itself, so nothing is done when the group does not exist yet."""

    def grant(apps, schema_editor):
        alias = schema_editor.connection.alias
        config = apps.get_app_config(app_label)
        models_module, config.models_module = getattr(config, "models_module", None), True
        try:  # historical app configs have no models module; create_permissions skips those
            create_permissions(config, verbosity=0, apps=apps, using=alias)
        finally:
            config.models_module = models_module
        group = apps.get_model("auth", "Group").objects.using(alias).filter(name="Operators").first()
        if group is not None:
            group.permissions.add(*apps.get_model("auth", "Permission").objects.using(alias).filter(
                content_type__app_label=app_label, codename=f"view_{model_name}"))

    return migrations.RunPython(grant, migrations.RunPython.noop)
