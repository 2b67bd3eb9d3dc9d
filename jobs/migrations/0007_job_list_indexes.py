from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0006_job_traceparent'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='job',
            index=models.Index(fields=['state', 'id'], name='job_state_id_idx'),
        ),
        migrations.AddIndex(
            model_name='job',
            index=models.Index(fields=['type', 'id'], name='job_type_id_idx'),
        ),
        migrations.AddIndex(
            model_name='job',
            index=models.Index(fields=['project', 'id'], name='job_project_id_idx'),
        ),
    ]
