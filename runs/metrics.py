"""The runs app's part of ``/metrics``: stuck runs, escalations, the last invariants check.

``runs_collect`` is registered in ``core.metrics.COLLECTORS`` (``RunsConfig.ready``); it reads
the database at scrape time, so every process answers the same figures. The result of the last
``check_invariants`` run is kept in the database too (one ``MetricTotal`` row per check, hidden
from the counters by its ``_`` name): ``invariants_record`` writes it, whichever process ran the
command, and every scrape reads it.
"""

from __future__ import annotations

from datetime import datetime, timezone as dt_timezone
from typing import Iterable, Iterator

from django.db import transaction
from django.db.models import Count, Min
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily

from core.metrics import labels_key
from core.models import MetricTotal
from runs.models import EscalationTicket, Run
from runs.selectors import run_stuck_q

INVARIANTS_SERIES = "_invariants_check"


def invariants_record(*, violations_by_check: dict[str, int], at: datetime | None = None) -> None:
    """Keep the outcome of one ``check_invariants`` run: per check, when and how many violations."""
    at = at or timezone.now()
    stamp = at.timestamp()
    with transaction.atomic():
        for check, count in sorted(violations_by_check.items()):
            MetricTotal.objects.update_or_create(name=INVARIANTS_SERIES, labels=labels_key({"check": check}),
                                                 defaults={"count": int(count), "total": stamp})


def invariants_last() -> dict[str, tuple[int, datetime]]:
    """``{check: (violations, checked at)}`` of the last run of each check."""
    import json

    result = {}
    for labels, count, stamp in (MetricTotal.objects.filter(name=INVARIANTS_SERIES)
                                 .values_list("labels", "count", "total")):
        result[json.loads(labels).get("check", "")] = (int(count),
                                                       datetime.fromtimestamp(stamp, tz=dt_timezone.utc))
    return result


def runs_collect(now: datetime) -> Iterator:
    """Runs by state, stuck runs, open escalations and the last invariants check."""
    yield from runs_by_state()
    yield GaugeMetricFamily("orchestrator_runs_stuck",
                            "Runs the admin's stuck filter lists: running without a worker heartbeat, or in a "
                            "state longer than its timeout.",
                            value=Run.objects.filter(run_stuck_q(now=now), deleted_at__isnull=True).count())
    yield from _escalations(now)
    yield from _invariants(now)


def _escalations(now: datetime) -> Iterable:
    rows = (EscalationTicket.objects.filter(status=EscalationTicket.Status.OPEN).values("trigger")
            .annotate(n=Count("id"), oldest=Min("created_at")).order_by("trigger"))
    open_by_trigger = GaugeMetricFamily("orchestrator_escalations_open",
                                        "Escalation tickets open (not acknowledged yet), by trigger.",
                                        labels=("trigger",))
    oldest = None
    counts = {row["trigger"]: row["n"] for row in rows}
    for row in rows:
        if oldest is None or row["oldest"] < oldest:
            oldest = row["oldest"]
    for trigger in EscalationTicket.Trigger.values:
        open_by_trigger.add_metric([trigger], counts.get(trigger, 0))
    yield open_by_trigger
    yield GaugeMetricFamily("orchestrator_escalation_oldest_open_seconds",
                            "How long the oldest open escalation ticket has waited for an acknowledgement "
                            "(0: none is open).",
                            value=0.0 if oldest is None else max(0.0, (now - oldest).total_seconds()))


def _invariants(now: datetime) -> Iterable:
    last = invariants_last()
    violations = GaugeMetricFamily("orchestrator_invariant_violations",
                                   "Violations found by the last check_invariants run, per check "
                                   "(absent: never checked).", labels=("check",))
    checked = GaugeMetricFamily("orchestrator_invariants_last_check_timestamp_seconds",
                                "Unix time of the last check_invariants run, per check.", labels=("check",))
    for check, (count, at) in sorted(last.items()):
        violations.add_metric([check], count)
        checked.add_metric([check], at.timestamp())
    yield violations
    yield checked


def runs_by_state() -> Iterator:
    counts = dict(Run.objects.filter(deleted_at__isnull=True).values_list("status")
                  .annotate(n=Count("id")).order_by())
    gauge = GaugeMetricFamily("orchestrator_runs", "Runs, by state.", labels=("state",))
    for state in Run.Status.values:
        gauge.add_metric([state], counts.get(state, 0))
    yield gauge
