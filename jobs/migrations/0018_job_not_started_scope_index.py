"""The jobs not started yet, by organization and project: the caps' counts at every enqueue read
these rows only (the project's finished jobs and the rest of the table are not in the index)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('core', '0008_event_write_indexes'),
        ('jobs', '0017_job_partial_lease_lane_indexes'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='job',
            index=models.Index(condition=models.Q(('state__in', ['received', 'queued', 'awaiting_tool',
                                                                 'awaiting_user_confirmation'])),
                               fields=['organization', 'project'], name='job_not_started_scope_idx'),
        ),
    ]
