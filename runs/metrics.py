"""The runs app's part of ``/metrics``: stuck runs, escalations, the last invariants check, and the
finished runs counter.

``orchestrator_runs_finished_total{state, reason}`` is derived from the tables at scrape time
(``RUNS_FINISHED`` in ``core.metrics.DERIVED``), not written by the transitions: every move of a
run into completed, failed or cancelled closes its current attempt with that outcome (a failure
with its error code, the reason label), except two that leave a cancelled run whose current
attempt is not ``cancelled``: a run cancelled before it started (no attempt) and a failed run
voided (its attempt stays ``failed``). Cancelled is final, so those are counted from the run.
Runs and attempts are never deleted.

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

from django.db import connection

from core.metrics import Derived, labels_key
from core.models import MetricTotal
from runs.models import SETTLED_RUN_STATES, EscalationTicket, Run, RunAttempt
from runs.selectors import run_stuck_q

INVARIANTS_SERIES = "_invariants_check"


def _runs_finished_sql() -> tuple[str, list]:
    q = connection.ops.quote_name
    attempts, runs = q(RunAttempt._meta.db_table), q(Run._meta.db_table)
    settled = sorted(SETTLED_RUN_STATES)
    marks = ", ".join(["%s"] * len(settled))
    failed, cancelled = Run.Status.FAILED.value, Run.Status.CANCELLED.value
    sql = (f"SELECT {q('outcome')} AS k1, CASE WHEN {q('outcome')} = %s THEN {q('error_code')} ELSE '' END AS k2, "
           f"COUNT(*) AS v1 FROM {attempts} WHERE {q('outcome')} IN ({marks}) GROUP BY 1, 2 "
           f"UNION ALL SELECT %s AS k1, '' AS k2, COUNT(*) AS v1 FROM {runs} AS r WHERE r.{q('status')} = %s "
           f"AND NOT EXISTS (SELECT 1 FROM {attempts} AS a WHERE a.{q('run_id')} = r.{q('id')} "
           f"AND a.{q('number')} = r.{q('attempt_number')} AND a.{q('outcome')} = %s)")
    return sql, [failed, *settled, cancelled, cancelled, cancelled]


def _runs_finished_series(keys: tuple, values: tuple):
    state, reason = keys[0], keys[1] or ""
    if values[0]:
        yield "runs_finished", {"state": state, "reason": reason}, values[0], 0.0


RUNS_FINISHED = Derived(name="runs_finished", keys=2, values=1, sql=_runs_finished_sql,
                        series=_runs_finished_series)


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
