"""The job counters (attempts, retries, finished jobs, run and wait time) are derived from the job
table at scrape time from now on, on top of the metric base (``core.metrics``). The base so far
counted every transition, including those of the jobs still in the table, which the table now
counts itself: take those out of the base once, so every counter reads the same before and after.
"""

from django.db import migrations

from jobs.counters import TALLY_FIELDS, job_tally

TERMINAL = ("completed", "failed", "cancelled")
CHUNK = 5_000


def _rows(Job):
    last = 0
    while True:
        rows = list(Job.objects.filter(pk__gt=last).order_by("pk").values_list("pk", *TALLY_FIELDS)[:CHUNK])
        if not rows:
            return
        last = rows[-1][0]
        yield from (row[1:] for row in rows)


def _move(apps, sign):
    Job = apps.get_model("jobs", "Job")
    MetricDelta = apps.get_model("core", "MetricDelta")
    tally = job_tally(_rows(Job), TERMINAL)
    MetricDelta.objects.bulk_create([MetricDelta(name=row.name, labels=row.labels, count=row.count, total=row.total)
                                     for row in tally.rows(sign)])


def forward(apps, schema_editor):
    _move(apps, -1)


def backward(apps, schema_editor):
    _move(apps, 1)


class Migration(migrations.Migration):
    dependencies = [
        ("core", "0007_bulk_operation"),
        ("jobs", "0009_queue_pause"),
    ]

    operations = [migrations.RunPython(forward, backward)]
