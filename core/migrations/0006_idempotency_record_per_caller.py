"""Idempotency keys are per caller: the record names its user, and the key is unique per
(organization, user, key, endpoint). Rows written before have no user; no caller matches them
and they expire with ``ORCHESTRATOR_IDEMPOTENCY_TTL_S``."""

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('core', '0005_retention_schedule'),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name='idempotencyrecord',
            name='idempotency_unique_key',
        ),
        migrations.AddField(
            model_name='idempotencyrecord',
            name='user',
            field=models.ForeignKey(help_text='the caller (empty only on rows written before keys were per caller)', null=True, on_delete=django.db.models.deletion.CASCADE, related_name='+', to=settings.AUTH_USER_MODEL),
        ),
        migrations.AddConstraint(
            model_name='idempotencyrecord',
            constraint=models.UniqueConstraint(fields=('organization', 'user', 'key', 'endpoint'), name='idempotency_unique_caller_key'),
        ),
    ]
