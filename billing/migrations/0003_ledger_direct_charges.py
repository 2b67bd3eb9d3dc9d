"""Direct charges: a ``charge`` with no run debits the balance only (source ``direct``).

A command job's tool is charged this way (it has no run and no reservation). The check
constraint keeps the two kinds of charge apart; the base manager becomes the guarded
``objects`` so Django's internal update and delete paths meet the append-only refusal too.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("billing", "0002_ledger_append_only_trigger")]

    operations = [
        migrations.AlterModelOptions(
            name="ledgerentry",
            options={"base_manager_name": "objects", "ordering": ["id"], "verbose_name_plural": "ledger entries"},
        ),
        migrations.AlterField(
            model_name="ledgerentry",
            name="source",
            field=models.CharField(blank=True, choices=[("", "—"), ("reservation", "Unused reservation"),
                                                        ("charge", "Charged credits"), ("direct", "Direct debit")],
                                   default="", max_length=16),
        ),
        migrations.AddConstraint(
            model_name="ledgerentry",
            constraint=models.CheckConstraint(
                condition=~models.Q(kind="charge") | models.Q(run__isnull=False, source="")
                | models.Q(run__isnull=True, source="direct"),
                name="ledger_charge_source_matches_run"),
        ),
    ]
