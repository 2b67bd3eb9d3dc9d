"""``orchestrator_runs_finished_total`` is derived from the run attempts at scrape time from now on
(``runs.metrics``), on top of the metric base. The base so far counted every run that finished,
which the attempts now count themselves: take those out of the base once, so the counter reads
the same before and after.
"""

import json

from django.db import migrations
from django.db.models import Count, Exists, OuterRef

SETTLED = ("completed", "failed", "cancelled")


def _labels(state, reason):
    return json.dumps({"reason": reason, "state": state}, sort_keys=True, separators=(",", ":"))


def _move(apps, sign):
    Run = apps.get_model("runs", "Run")
    RunAttempt = apps.get_model("runs", "RunAttempt")
    MetricDelta = apps.get_model("core", "MetricDelta")
    counts: dict[tuple[str, str], int] = {}
    for outcome, error_code, n in (RunAttempt.objects.filter(outcome__in=SETTLED).values_list("outcome", "error_code")
                                   .annotate(n=Count("id")).order_by()):
        key = (outcome, error_code if outcome == "failed" else "")
        counts[key] = counts.get(key, 0) + n
    closed = RunAttempt.objects.filter(run_id=OuterRef("pk"), number=OuterRef("attempt_number"), outcome="cancelled")
    others = Run.objects.filter(status="cancelled").exclude(Exists(closed)).count()
    if others:
        counts[("cancelled", "")] = counts.get(("cancelled", ""), 0) + others
    MetricDelta.objects.bulk_create([MetricDelta(name="runs_finished", labels=_labels(state, reason), count=sign * n,
                                                 total=0.0) for (state, reason), n in sorted(counts.items())])


def forward(apps, schema_editor):
    _move(apps, -1)


def backward(apps, schema_editor):
    _move(apps, 1)


class Migration(migrations.Migration):
    dependencies = [
        ("core", "0007_bulk_operation"),
        ("runs", "0013_run_alive_organization_index"),
    ]

    operations = [migrations.RunPython(forward, backward)]
