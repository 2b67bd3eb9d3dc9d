"""One incident per run, step 1 of 2: a ticket lists the triggers it gathered (``triggers``), and a
run's several unresolved tickets (one per trigger was allowed until now) are merged into its oldest
one: their triggers and details go onto it, and each of them is resolved with a resolution naming
the ticket it went into (nothing is deleted, the history stays readable). Step 2
(0010_escalation_one_unresolved_per_run) then swaps the unique constraint."""

from django.db import migrations, models
from django.db.models import Count
from django.utils import timezone

UNRESOLVED = ("open", "acknowledged")


def _entry(ticket) -> dict:
    return {"trigger": ticket.trigger, "at": ticket.created_at.isoformat(), "detail": ticket.detail}


def merge_open_tickets(apps, schema_editor):
    EscalationTicket = apps.get_model("runs", "EscalationTicket")
    for ticket in EscalationTicket.objects.only("pk", "trigger", "created_at", "detail").iterator():
        EscalationTicket.objects.filter(pk=ticket.pk).update(triggers=[_entry(ticket)])
    runs = (EscalationTicket.objects.filter(status__in=UNRESOLVED).values("run_id").annotate(n=Count("id"))
            .filter(n__gt=1).values_list("run_id", flat=True))
    now = timezone.now()
    for run_id in list(runs):
        tickets = list(EscalationTicket.objects.filter(run_id=run_id, status__in=UNRESOLVED).order_by("created_at", "pk"))
        oldest, others = tickets[0], tickets[1:]
        triggers = [_entry(oldest)] + [_entry(t) for t in others]
        detail = oldest.detail + "".join(
            f"\n{t.created_at:%Y-%m-%d %H:%M:%S} {t.trigger} (merged from ticket {t.pk}): {t.detail}" for t in others)
        severity = oldest.severity
        EscalationTicket.objects.filter(pk=oldest.pk).update(triggers=triggers, detail=detail, severity=severity)
        for other in others:
            # queryset.update: the status field is protected against assignment on instances
            EscalationTicket.objects.filter(pk=other.pk).update(
                status="resolved", resolved_at=now, resolution=f"merged into escalation ticket {oldest.pk}")


class Migration(migrations.Migration):

    dependencies = [
        ("runs", "0009_runbook_permissions_declared_by_runbooks"),
    ]

    operations = [
        migrations.AddField(
            model_name="escalationticket",
            name="triggers",
            field=models.JSONField(blank=True, default=list,
                                   help_text="every trigger the ticket gathered: trigger, at (ISO time), detail"),
        ),
        migrations.RunPython(merge_open_tickets, migrations.RunPython.noop),
    ]
