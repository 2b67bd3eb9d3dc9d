"""Fewer index entries per job row write: the lease index holds the executing jobs only (a job's
enqueue and completion write no entry there), and the lane index the jobs of a lane only (a job
outside any lane writes none, in any state)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('core', '0008_event_write_indexes'),
        ('jobs', '0016_job_write_indexes'),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name='job',
            name='job_state_lease_idx',
        ),
        migrations.RemoveIndex(
            model_name='job',
            name='job_lane_state_idx',
        ),
        migrations.AddIndex(
            model_name='job',
            index=models.Index(condition=models.Q(('state', 'executing')), fields=['lease_expires_at'],
                               name='job_executing_lease_idx'),
        ),
        migrations.AddIndex(
            model_name='job',
            index=models.Index(condition=models.Q(('lane', ''), _negated=True), fields=['lane', 'state'],
                               name='job_lane_state_idx'),
        ),
    ]
