"""The operations dashboard's snapshot: one read of the whole system for the console.

``dashboard_snapshot()`` gathers, in a fixed number of grouped queries whatever the number of
rows (about fifteen): queue depth by lane and by job type, executing jobs and their age, worker
liveness, runs by live status and stuck runs (``runs.selectors.run_stuck_q``, the rule of the
run list's "stuck" filter and of the recovery runbook; counted up to
``ORCHESTRATOR_DASHBOARD_COUNT_LIMIT``, "1000+" beyond, so a million runs cost what a thousand do), failures of the last hour by reason,
credits held by open reservations, open escalations, and a per-minute series of completions
and failures over the last hour (read from the event log, whose ``created_at`` is indexed, so
its cost follows the last hour's traffic and not the size of the tables).

Every figure carries the admin changelist that lists the same rows (``links``), so an operator
goes from a number to the rows behind it in one click. This module reads across the apps, like
the admin does; it writes nothing.
"""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache
from typing import Any
from urllib.parse import urlencode

from django.conf import settings
from django.db import connections
from django.db.models import Count, Q, Sum
from django.db.models.functions import TruncMinute
from django.urls import get_script_prefix, get_urlconf, reverse
from django.utils import timezone

from billing.models import CreditAccount
from core.admin_scale import counts_bounded
from core.models import Event
from jobs.events import JOB_COMPLETED, JOB_FAILED
from jobs.models import WAITING_JOB_STATES, Job, JobState
from jobs.selectors import queue_overview, queue_pause_list
from runs.events import run_event
from runs.models import LIVE_RUN_STATES, OPEN_ESCALATION_STATES, EscalationTicket, Run
from runs.selectors import RUN_STUCK_PART_ORDERINGS, run_stuck_parts, run_stuck_q

FAILURE_WINDOW = timedelta(hours=1)
CHART_MINUTES = 60
CHART_EVENTS = {
    JOB_COMPLETED: "jobs_completed",
    run_event(Run.Status.COMPLETED): "runs_completed",
    JOB_FAILED: "jobs_failed",
    run_event(Run.Status.FAILED): "runs_failed",
}
WAITING_STATES_PARAM = ",".join(sorted(WAITING_JOB_STATES))


@lru_cache(maxsize=128)
def _admin_url(view: str, script_prefix: str, urlconf: Any, root_urlconf: str) -> str:
    """An admin view's URL (a change page's with the id 0), reversed once per prefix and URLconf:
    a snapshot links about a hundred figures and rows to a dozen views."""
    return reverse(f"admin:{view}", args=[0] if view.endswith("_change") else None)


def _url(view: str) -> str:
    return _admin_url(view, get_script_prefix(), get_urlconf(), settings.ROOT_URLCONF)


def _changelist(name: str, **params: Any) -> str:
    url = _url(f"{name}_changelist")
    return f"{url}?{urlencode(params)}" if params else url


def _change(name: str, object_id: Any) -> str:
    return f"{_url(f'{name}_change')[:-len('0/change/')]}{int(object_id)}/change/"


def _age_s(since, now) -> float | None:
    return None if since is None else round((now - since).total_seconds(), 1)


def _queue(now, limit: int) -> dict[str, Any]:
    queue = queue_overview(now=now, limit=limit)
    for row in queue["by_lane"]:
        row["url"] = _changelist("jobs_job", lane=row["key"], state__in=WAITING_STATES_PARAM)
    for row in queue["by_type"]:
        row["url"] = _changelist("jobs_job", type__exact=row["key"], state__in=WAITING_STATES_PARAM)
    for row in queue["executing_jobs"]:
        row["url"] = _change("jobs_job", row["id"])
        row["run_url"] = _change("runs_run", row["run"]) if row["run"] else None
    queue["paused"] = queue_pause_list()
    for row in queue["paused"]:
        row["url"] = _changelist("jobs_job", state__in=WAITING_STATES_PARAM, **(
            {"project__id__exact": row["project"]} if row["project"] else {"type__exact": row["job_type"]}))
    return queue


def _runs(now, limit: int) -> dict[str, Any]:
    """Live runs by status and the stuck runs, in two queries whatever the number of live runs:
    every count stops at ``ORCHESTRATOR_DASHBOARD_COUNT_LIMIT`` + 1 rows (``bounded`` names the
    figures that reached it: "1000+"), and the stuck list merges the first ``limit`` of each
    disjoint part of the stuck rule (``run_stuck_parts``: an index range each, read along it: the
    longest in a waiting status, the longest silent among running runs), longest in status first."""
    count_limit = settings.ORCHESTRATOR_DASHBOARD_COUNT_LIMIT
    parts = run_stuck_parts(now=now)
    counted = counts_bounded({
        # Each count walks the index its ordering names: (status, id); each stuck part its own.
        **{state: Run.objects.filter(status=state).order_by("id") for state in LIVE_RUN_STATES},
        **{f"stuck-{index}": Run.objects.filter(part).order_by(*ordering)
           for index, (part, ordering) in enumerate(zip(parts, RUN_STUCK_PART_ORDERINGS))}}, count_limit)
    by_status = {state: min(counted[state], count_limit) for state in LIVE_RUN_STATES}
    stuck_count = sum(counted[f"stuck-{index}"] for index in range(len(parts)))
    bounded = [f"runs-{state}" for state in LIVE_RUN_STATES if counted[state] > count_limit]
    if bounded:
        bounded.append("runs-live")
    if stuck_count > count_limit:
        bounded.append("runs-stuck")
    fields = ("id", "name", "status", "status_reason", "status_changed_at", "last_heartbeat")
    order = ("status_changed_at", "id")
    if connections[Run.objects.db].features.supports_slicing_ordering_in_compound:
        # Each part's first ``limit`` along its own index (a waiting status: the longest in it; a
        # running run: the longest silent), then the longest in their status first.
        pieces = [Run.objects.filter(part).order_by(*(ordering or order)).values(*fields)[:limit]
                  for part, ordering in zip(parts, RUN_STUCK_PART_ORDERINGS)]
        stuck = pieces[0].union(*pieces[1:], all=True).order_by(*order)[:limit]
    else:  # SQLite cannot order its parts: one query over the rule (a small embedded database)
        stuck = Run.objects.filter(run_stuck_q(now=now)).order_by(*order).values(*fields)[:limit]
    stuck_rows = [
        {"id": row["id"], "name": row["name"], "status": row["status"], "status_reason": row["status_reason"],
         "in_status_s": _age_s(row["status_changed_at"], now), "heartbeat_age_s": _age_s(row["last_heartbeat"], now),
         "url": _change("runs_run", row["id"])}
        for row in stuck
    ]
    return {
        "by_status": by_status,
        "live": sum(by_status.values()),
        "stuck_count": min(stuck_count, count_limit),
        "stuck": stuck_rows,
        "count_limit": count_limit,
        "bounded": bounded,
    }


def _failures(now) -> dict[str, Any]:
    since = now - FAILURE_WINDOW
    jobs = [
        {"reason": row["reason"] or "", "count": row["n"],
         "url": _changelist("jobs_job", state__exact=JobState.FAILED, reason__exact=row["reason"] or "",
                            completed_at_within="1h")}
        for row in Job.objects.filter(state=JobState.FAILED, completed_at__gte=since).values("reason")
        .annotate(n=Count("id")).order_by("-n", "reason")
    ]
    runs = []
    for row in (Run.objects.filter(status=Run.Status.FAILED, status_changed_at__gte=since).values("last_error_code")
                .annotate(n=Count("id")).order_by("-n", "last_error_code")):
        params = {"status__exact": Run.Status.FAILED, "status_changed_at_within": "1h"}
        if row["last_error_code"]:
            params["last_error_code"] = row["last_error_code"]
        runs.append({"code": row["last_error_code"] or "", "count": row["n"], "url": _changelist("runs_run", **params)})
    return {"window_s": int(FAILURE_WINDOW.total_seconds()), "jobs_by_reason": jobs, "runs_by_code": runs,
            "jobs_total": sum(row["count"] for row in jobs), "runs_total": sum(row["count"] for row in runs)}


def _credits(limit: int) -> dict[str, Any]:
    totals = CreditAccount.objects.aggregate(total_reserved=Sum("reserved"),
                                             organizations=Count("id", filter=Q(reserved__gt=0)))
    top = [
        {"organization": row["organization__name"], "organization_id": row["organization_id"],
         "reserved": row["reserved"], "available": row["balance"] - row["reserved"],
         "url": _change("billing_creditaccount", row["id"])}
        for row in CreditAccount.objects.filter(reserved__gt=0).order_by("-reserved", "organization_id").values(
            "id", "organization_id", "organization__name", "reserved", "balance")[:limit]
    ]
    return {"reserved": totals["total_reserved"] or 0, "organizations": totals["organizations"], "top": top}


def _escalations(limit: int) -> dict[str, Any]:
    by_status = dict(EscalationTicket.objects.filter(status__in=OPEN_ESCALATION_STATES).values_list("status")
                     .annotate(n=Count("id")).order_by())
    latest = [
        {"id": row["id"], "run": row["run_id"], "trigger": row["trigger"], "severity": row["severity"],
         "status": row["status"], "created_at": row["created_at"].isoformat(),
         "url": _change("runs_escalationticket", row["id"]), "run_url": _change("runs_run", row["run_id"])}
        for row in EscalationTicket.objects.filter(status__in=OPEN_ESCALATION_STATES).order_by("-id").values(
            "id", "run_id", "trigger", "severity", "status", "created_at")[:limit]
    ]
    return {"open": by_status.get(EscalationTicket.Status.OPEN, 0),
            "acknowledged": by_status.get(EscalationTicket.Status.ACKNOWLEDGED, 0), "latest": latest}


def _chart(now) -> dict[str, Any]:
    """Completions and failures per minute over the last hour, oldest minute first."""
    start = now.replace(second=0, microsecond=0) - timedelta(minutes=CHART_MINUTES - 1)
    series = {name: [0] * CHART_MINUTES for name in CHART_EVENTS.values()}
    # Only the time range is in the WHERE clause, so the plan is a range scan of the created_at
    # index on every engine; the event types are counted per minute in the same pass.
    counts = {name: Count("id", filter=Q(type=event_type)) for event_type, name in CHART_EVENTS.items()}
    rows = (Event.objects.filter(created_at__gte=start).annotate(minute=TruncMinute("created_at"))
            .values("minute").annotate(**counts).order_by())
    for row in rows:
        index = int((row["minute"] - start).total_seconds() // 60)
        if 0 <= index < CHART_MINUTES:
            for name in CHART_EVENTS.values():
                series[name][index] += row[name]
    series["failures"] = [jobs + runs for jobs, runs in zip(series["jobs_failed"], series["runs_failed"])]
    return {"start": start.isoformat(), "step_s": 60, "buckets": CHART_MINUTES, "series": series,
            "totals": {name: sum(values) for name, values in series.items()}}


def dashboard_snapshot(*, now=None, limit: int = 20) -> dict[str, Any]:
    """Everything the dashboard shows, as JSON-ready data (see the module docstring).

    ``metrics`` is the flat list of headline figures (the page's ``data-metric`` elements carry
    the same names) and ``links`` the changelist behind each of them; the other keys hold the
    tables (at most ``limit`` rows each) and the chart.
    """
    now = now or timezone.now()
    queue = _queue(now, limit)
    runs = _runs(now, limit)
    failures = _failures(now)
    credits = _credits(limit)
    escalations = _escalations(limit)
    chart = _chart(now)
    metrics = {
        "jobs-waiting": queue["waiting"],
        "jobs-delayed": queue["delayed"],
        "jobs-executing": queue["executing"],
        "jobs-concurrency": queue["concurrency"],
        "jobs-received": queue["received"],
        "jobs-awaiting-confirmation": queue["awaiting_user_confirmation"],
        "runs-live": runs["live"],
        **{f"runs-{state}": count for state, count in runs["by_status"].items()},
        "runs-stuck": runs["stuck_count"],
        "failures-jobs-1h": failures["jobs_total"],
        "failures-runs-1h": failures["runs_total"],
        "credits-reserved": credits["reserved"],
        "credits-organizations": credits["organizations"],
        "escalations-open": escalations["open"],
        "escalations-acknowledged": escalations["acknowledged"],
        "workers-alive": queue["workers_alive"],
        "workers-stale": queue["workers_stale"],
        "throughput-jobs-1h": chart["totals"]["jobs_completed"],
        "throughput-runs-1h": chart["totals"]["runs_completed"],
        "failures-1h": chart["totals"]["failures"],
    }
    waiting = _changelist("jobs_job", state__in=WAITING_STATES_PARAM)
    links = {
        "jobs-waiting": waiting,
        "jobs-delayed": waiting,
        "jobs-executing": _changelist("jobs_job", state__exact=JobState.EXECUTING),
        "jobs-received": _changelist("jobs_job", state__exact=JobState.RECEIVED),
        "jobs-awaiting-confirmation": _changelist("jobs_job", state__exact=JobState.AWAITING_USER_CONFIRMATION),
        "runs-live": _changelist("runs_run", status__in=",".join(LIVE_RUN_STATES)),
        **{f"runs-{state}": _changelist("runs_run", status__exact=state) for state in LIVE_RUN_STATES},
        "runs-stuck": _changelist("runs_run", stuck="yes"),
        "failures-jobs-1h": _changelist("jobs_job", state__exact=JobState.FAILED, completed_at_within="1h"),
        "failures-runs-1h": _changelist("runs_run", status__exact=Run.Status.FAILED, status_changed_at_within="1h"),
        "credits-reserved": _changelist("billing_creditaccount", reserved__gt=0),
        "credits-organizations": _changelist("billing_creditaccount", reserved__gt=0),
        "escalations-open": _changelist("runs_escalationticket", status__exact=EscalationTicket.Status.OPEN),
        "escalations-acknowledged": _changelist("runs_escalationticket",
                                                status__exact=EscalationTicket.Status.ACKNOWLEDGED),
        "workers-alive": _changelist("jobs_workerheartbeat"),
        "workers-stale": _changelist("jobs_workerheartbeat"),
        "throughput-jobs-1h": _changelist("jobs_job", state__exact=JobState.COMPLETED, completed_at_within="1h"),
        "throughput-runs-1h": _changelist("runs_run", status__exact=Run.Status.COMPLETED,
                                          status_changed_at_within="1h"),
        "failures-1h": _changelist("core_event", type__in=",".join(
            [JOB_FAILED, run_event(Run.Status.FAILED)]), created_at_within="1h"),
    }
    return {
        "at": now.isoformat(),
        "metrics": metrics,
        # Figures that reached their bound: at least this many (shown "1000+").
        "bounded": runs["bounded"],
        "links": links,
        "queue": queue,
        "runs": runs,
        "failures": failures,
        "credits": credits,
        "escalations": escalations,
        "chart": chart,
    }
