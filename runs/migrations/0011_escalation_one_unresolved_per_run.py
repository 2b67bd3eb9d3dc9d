"""One incident per run, step 2 of 2: at most one unresolved escalation ticket per run (0009 merged
the tickets that would break it)."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("runs", "0010_escalation_triggers_merge_open_tickets"),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name="escalationticket",
            name="escalation_one_unresolved_per_trigger",
        ),
        migrations.AddConstraint(
            model_name="escalationticket",
            constraint=models.UniqueConstraint(condition=models.Q(("status", "resolved"), _negated=True),
                                               fields=("run",), name="escalation_one_unresolved_per_run"),
        ),
    ]
