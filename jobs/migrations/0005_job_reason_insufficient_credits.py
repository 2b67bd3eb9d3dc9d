
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0004_job_organization_slot_and_cap'),
    ]

    operations = [
        migrations.AlterField(
            model_name='job',
            name='reason',
            field=models.CharField(blank=True, choices=[('', '—'), ('completed', 'Completed'), ('deadline_fallback', 'Deadline passed: fallback result'), ('cancelled', 'Cancelled'), ('retry_scheduled', 'Retry scheduled'), ('lease_expired', 'Worker lost: lease expired'), ('max_attempts_exhausted', 'Attempts exhausted'), ('max_failures_exhausted', 'Failures exhausted'), ('fatal_error', 'Fatal error'), ('timeout', 'Timed out'), ('recovery_exhausted', 'Recovery exhausted'), ('invalid_payload', 'Invalid or unknown payload'), ('interrupt_timeout', 'Did not stop within the graceful window'), ('shutdown_timeout', 'Worker shut down mid-job'), ('insufficient_credits', 'The organization could not pay for it')], default='', max_length=40),
        ),
    ]
