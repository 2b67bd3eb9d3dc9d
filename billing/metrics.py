"""The billing app's part of ``/metrics``: credits reserved and the ledger by kind.

``billing_collect`` is registered in ``core.metrics.COLLECTORS`` and ``ledger_rollup`` in
``core.metrics.COMPACTORS`` (``BillingConfig.ready``). The ledger counters are the rolled-up totals
plus the entries past the roll-up's watermark, read in one statement at scrape time; entries are
rolled up only once older than ``LEDGER_SETTLE``, so an entry that commits late is still counted.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Iterator

from django.db import connection, transaction
from django.db.models import Count, F, Max, Sum
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from billing.models import CreditAccount, LedgerEntry
from core.metrics import labels_key, metric_tables
from core.models import MetricTotal

LEDGER_SETTLE = timedelta(minutes=5)
LEDGER_SERIES = "ledger_entries"
LEDGER_WATERMARK = "_ledger_watermark"


def ledger_rollup(*, now=None) -> int:
    """Fold ledger entries older than ``LEDGER_SETTLE`` past the watermark into the totals."""
    now = now or timezone.now()
    with transaction.atomic():
        MetricTotal.objects.get_or_create(name=LEDGER_WATERMARK, labels="{}")
        mark = MetricTotal.objects.select_for_update().get(name=LEDGER_WATERMARK, labels="{}")
        upto = (LedgerEntry.objects.filter(id__gt=mark.count, created_at__lt=now - LEDGER_SETTLE)
                .aggregate(m=Max("id"))["m"])
        if upto is None:
            return 0
        rows = (LedgerEntry.objects.filter(id__gt=mark.count, id__lte=upto).values("kind")
                .annotate(n=Count("id"), amount=Sum("amount")).order_by("kind"))
        folded = 0
        for row in rows:
            total, _ = MetricTotal.objects.get_or_create(name=LEDGER_SERIES, labels=labels_key({"kind": row["kind"]}))
            MetricTotal.objects.filter(pk=total.pk).update(count=F("count") + row["n"],
                                                           total=F("total") + float(row["amount"] or 0))
            folded += row["n"]
        MetricTotal.objects.filter(pk=mark.pk).update(count=upto)
        return folded


def ledger_series() -> dict[str, tuple[int, int]]:
    """Ledger entries and credits by kind: the rolled-up totals plus entries past the watermark."""
    ledger = connection.ops.quote_name(LedgerEntry._meta.db_table)
    total = metric_tables()["total"]
    sql = (f"SELECT labels, SUM(n), SUM(amount) FROM ("
           f"SELECT labels, count AS n, total AS amount FROM {total} WHERE name = %s "
           f"UNION ALL SELECT '{{\"kind\":\"' || kind || '\"}}' AS labels, COUNT(*) AS n, "
           f"CAST(SUM(amount) AS DOUBLE PRECISION) AS amount FROM {ledger} "
           f"WHERE id > COALESCE((SELECT MAX(count) FROM {total} WHERE name = %s), 0) GROUP BY kind"
           f") AS entries GROUP BY labels")
    with connection.cursor() as cursor:
        cursor.execute(sql, [LEDGER_SERIES, LEDGER_WATERMARK])
        rows = cursor.fetchall()
    result = {}
    for labels, count, amount in rows:
        kind = json.loads(labels).get("kind", "")
        result[kind] = (int(count or 0), int(round(float(amount or 0))))
    return result


def billing_collect(now: datetime) -> Iterator:
    """Credits reserved (in all and per organization) and the ledger's entries and credits by kind."""
    ledger = ledger_series()
    entries = CounterMetricFamily("orchestrator_ledger_entries", "Credit ledger entries, by kind.",
                                  labels=("kind",))
    credits = CounterMetricFamily("orchestrator_ledger_credits", "Credits moved by ledger entries, by kind.",
                                  labels=("kind",))
    for kind, (count, amount) in sorted(ledger.items()):
        entries.add_metric([kind], count)
        credits.add_metric([kind], amount)
    yield entries
    yield credits
    total = CreditAccount.objects.aggregate(reserved=Sum("reserved"))["reserved"] or 0
    yield GaugeMetricFamily("orchestrator_credits_reserved", "Credits reserved for runs, in all organizations.",
                            value=total)
    by_organization = GaugeMetricFamily("orchestrator_organization_credits_reserved",
                                        "Credits reserved for runs, per organization (those holding some).",
                                        labels=("organization",))
    for organization_id, reserved in (CreditAccount.objects.filter(reserved__gt=0)
                                      .values_list("organization_id", "reserved").order_by("organization_id")):
        by_organization.add_metric([str(organization_id)], reserved)
    yield by_organization
