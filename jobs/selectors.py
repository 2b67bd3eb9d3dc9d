"""Reads of the queue for operators: depth by lane and type, executing jobs, workers seen, and
why a waiting job waits.

Every reader here runs a fixed number of grouped queries, whatever the number of jobs, and
follows the claim rules of ``jobs.services`` (``jobs_eligible`` and the order of ``job_claim``),
so what the console says is what the next claim does.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Iterable

from django.conf import settings
from django.db.models import Count, Min, Q, Subquery
from django.utils import timezone

from core.sql import db, hot_cursor, per_vendor, subqueries_row
from core.timefmt import isoformat_or_none
from jobs.models import (
    NOT_STARTED_JOB_STATES,
    WAITING_JOB_STATES,
    Job,
    JobLane,
    JobReason,
    JobState,
    PriorityClass,
    QueuePause,
    WorkerHeartbeat,
    index_states,
)
from jobs.services import jobs_eligible, organization_max_executing


def _age_s(since, now) -> float | None:
    return None if since is None else round((now - since).total_seconds(), 1)


def worker_alive_window_s() -> int:
    """A worker is alive when its heartbeat is younger than one job lease."""
    return settings.ORCHESTRATOR_QUEUE_LEASE_S


def _executing_jobs(now, limit: int) -> list[dict[str, Any]]:
    """The ``limit`` oldest executing jobs, oldest first, with their age and lease."""
    return [
        {"id": row["id"], "type": row["type"], "lane": row["lane"], "project": row["project_id"], "run": row["run_id"],
         "worker": row["worker"], "attempt": row["attempts"], "age_s": _age_s(row["started_at"], now),
         "lease_left_s": None if row["lease_expires_at"] is None
         else round((row["lease_expires_at"] - now).total_seconds(), 1),
         "cancel_requested": row["cancel_requested_at"] is not None}
        for row in Job.objects.filter(state=JobState.EXECUTING).order_by("started_at", "id").values(
            "id", "type", "lane", "project_id", "run_id", "worker", "attempts", "started_at", "lease_expires_at",
            "cancel_requested_at")[:limit]
    ]


def _workers(now, limit: int) -> list[dict[str, Any]]:
    """The ``limit`` most recently seen worker processes."""
    alive_window = worker_alive_window_s()
    return [
        {"worker": row["worker"], "cluster": row["cluster"], "last_seen_s": _age_s(row["last_seen"], now),
         "alive": (now - row["last_seen"]).total_seconds() <= alive_window, "current_job": row["current_job_id"],
         "jobs_done": row["jobs_done"], "up_s": _age_s(row["started_at"], now)}
        for row in WorkerHeartbeat.objects.order_by("-last_seen").values(
            "worker", "cluster", "last_seen", "current_job_id", "jobs_done", "started_at")[:limit]
    ]


def queue_status(*, now=None, limit: int = 50) -> dict[str, Any]:
    """A snapshot of the queue in four grouped queries (whatever the number of jobs).

    ``lanes``: waiting (claimable states) and executing jobs per lane and type, with the age of
    the oldest waiting one; ``executing``: the ``limit`` oldest executing jobs with their age and
    lease; ``workers``: worker processes by last heartbeat, alive when seen within one lease.
    """
    now = now or timezone.now()
    active = Job.objects.filter(state__in=[*WAITING_JOB_STATES, JobState.EXECUTING])
    lanes = [
        {"lane": row["lane"], "type": row["type"], "waiting": row["waiting"], "executing": row["executing"],
         "oldest_waiting_s": _age_s(row["oldest"], now)}
        for row in active.values("lane", "type").annotate(
            waiting=Count("id", filter=Q(state__in=WAITING_JOB_STATES)),
            executing=Count("id", filter=Q(state=JobState.EXECUTING)),
            oldest=Min("queued_at", filter=Q(state__in=WAITING_JOB_STATES)),
        ).order_by("lane", "type")
    ]
    totals = dict(Job.objects.filter(state__in=[*NOT_STARTED_JOB_STATES, JobState.EXECUTING])
                  .values_list("state").annotate(n=Count("id")).order_by())
    return {
        "at": now.isoformat(),
        "waiting": sum(totals.get(state, 0) for state in WAITING_JOB_STATES),
        "executing": totals.get(JobState.EXECUTING, 0),
        "received": totals.get(JobState.RECEIVED, 0),
        "awaiting_user_confirmation": totals.get(JobState.AWAITING_USER_CONFIRMATION, 0),
        "concurrency": settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY,
        "lanes": lanes,
        "executing_jobs": _executing_jobs(now, limit),
        "workers": _workers(now, limit),
    }


def _top(groups: dict[str, dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    rows = sorted(groups.values(), key=lambda row: (-row["waiting"], -row["executing"], row["key"]))
    return rows[:limit]


def queue_overview(*, now=None, limit: int = 20) -> dict[str, Any]:
    """The queue for the live dashboard, in five queries whatever the number of jobs.

    ``by_lane`` and ``by_type``: jobs waiting (of which ``delayed``: ``not_before`` still in the
    future), executing and the age of the oldest waiting one, the ``limit`` deepest groups
    (``lanes_total``/``types_total`` count them all); ``executing_jobs``: the ``limit`` oldest
    executing jobs; ``workers``: the ``limit`` most recently seen workers, and how many of all
    are alive or stale.
    """
    now = now or timezone.now()
    rows = (Job.objects.filter(state__in=[*NOT_STARTED_JOB_STATES, JobState.EXECUTING])
            .values("lane", "type").annotate(
                waiting=Count("id", filter=Q(state__in=WAITING_JOB_STATES)),
                delayed=Count("id", filter=Q(state__in=WAITING_JOB_STATES, not_before__gt=now)),
                executing=Count("id", filter=Q(state=JobState.EXECUTING)),
                received=Count("id", filter=Q(state=JobState.RECEIVED)),
                confirming=Count("id", filter=Q(state=JobState.AWAITING_USER_CONFIRMATION)),
                oldest=Min("queued_at", filter=Q(state__in=WAITING_JOB_STATES)),
            ).order_by())
    by_lane: dict[str, dict[str, Any]] = {}
    by_type: dict[str, dict[str, Any]] = {}
    totals = {"waiting": 0, "delayed": 0, "executing": 0, "received": 0, "awaiting_user_confirmation": 0}
    for row in rows:
        totals["waiting"] += row["waiting"]
        totals["delayed"] += row["delayed"]
        totals["executing"] += row["executing"]
        totals["received"] += row["received"]
        totals["awaiting_user_confirmation"] += row["confirming"]
        for groups, key in ((by_lane, row["lane"]), (by_type, row["type"])):
            group = groups.setdefault(key, {"key": key, "waiting": 0, "delayed": 0, "executing": 0, "oldest": None})
            group["waiting"] += row["waiting"]
            group["delayed"] += row["delayed"]
            group["executing"] += row["executing"]
            if row["oldest"] is not None and (group["oldest"] is None or row["oldest"] < group["oldest"]):
                group["oldest"] = row["oldest"]
    for groups in (by_lane, by_type):
        for group in groups.values():
            group["oldest_waiting_s"] = _age_s(group.pop("oldest"), now)
    alive_since = now - timedelta(seconds=worker_alive_window_s())
    seen = WorkerHeartbeat.objects.aggregate(alive=Count("worker", filter=Q(last_seen__gte=alive_since)),
                                             total=Count("worker"))
    return {
        "at": now.isoformat(),
        **totals,
        "concurrency": settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY,
        "by_lane": _top(by_lane, limit),
        "lanes_total": len(by_lane),
        "by_type": _top(by_type, limit),
        "types_total": len(by_type),
        "executing_jobs": _executing_jobs(now, limit),
        "workers": _workers(now, limit),
        "workers_alive": seen["alive"],
        "workers_stale": seen["total"] - seen["alive"],
        "worker_alive_window_s": worker_alive_window_s(),
    }


# --- why is this job waiting? ----------------------------------------------------------------

def _claim_ahead_q(job: Job) -> Q:
    """Jobs before ``job`` in the claim order: lower priority, then interactive first, then FIFO."""
    return (Q(priority__lt=job.priority) | Q(priority=job.priority, class_rank__lt=job.class_rank)
            | Q(priority=job.priority, class_rank=job.class_rank, id__lt=job.pk))


def _aged_q(now) -> Q:
    """Background jobs that waited past the aging guard in a lane that ran its interactive burst:
    ``job_claim`` takes these first, oldest first (the same test as ``jobs.services.claim._pick``)."""
    aging = now - timedelta(milliseconds=settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS)
    saturated = JobLane.objects.filter(interactive_streak__gte=settings.ORCHESTRATOR_QUEUE_MAX_INTERACTIVE_BURST)
    return Q(priority_class=PriorityClass.BACKGROUND, queued_at__lte=aging, lane__in=Subquery(saturated.values("key")))


def _seconds_until(moment, now) -> float | None:
    return None if moment is None else round(max(0.0, (moment - now).total_seconds()), 1)


def jobs_wait_explain(jobs: Iterable[Job], *, now=None) -> dict[int, dict[str, Any]]:
    """``job_wait_explain`` for several jobs: four shared queries, then one per waiting job."""
    jobs = list(jobs)
    now = now or timezone.now()
    if not jobs:
        return {}
    executing = list(Job.objects.filter(state=JobState.EXECUTING).order_by("started_at", "id").values(
        "id", "type", "lane", "worker", "started_at", "timeout_s", "run_id", "organization_id"))
    holders = {row["lane"]: row for row in executing if row["lane"]}
    lanes = {job.lane for job in jobs if job.lane}
    streaks = dict(JobLane.objects.filter(key__in=lanes).values_list("key", "interactive_streak")) if lanes else {}
    alive_since = now - timedelta(seconds=worker_alive_window_s())
    workers_alive = WorkerHeartbeat.objects.filter(last_seen__gte=alive_since).count()
    pauses = queue_pauses_of(jobs)
    return {job.pk: _explain(job, now=now, executing=executing, holders=holders, streaks=streaks,
                             workers_alive=workers_alive, pause=pauses.get(job.pk)) for job in jobs}


def queue_pause_as_dict(pause: QueuePause) -> dict[str, Any]:
    return {"queue": pause.queue, "project": pause.project_id, "job_type": pause.job_type or None,
            "by": pause.actor_label, "reason": pause.reason, "since": pause.since.isoformat()}


def queue_pauses_of(jobs: Iterable[Job]) -> dict[int, QueuePause]:
    """The pause holding each of ``jobs`` (its project's, else its type's), in one query."""
    jobs = list(jobs)
    projects = {job.project_id for job in jobs}
    types = {job.type for job in jobs}
    rows = list(QueuePause.objects.filter(Q(project_id__in=projects) | Q(job_type__in=types)))
    by_project = {row.project_id: row for row in rows if row.project_id}
    by_type = {row.job_type: row for row in rows if row.job_type}
    found = {job.pk: by_project.get(job.project_id) or by_type.get(job.type) for job in jobs}
    return {pk: pause for pk, pause in found.items() if pause is not None}


def queue_pause_list() -> list[dict[str, Any]]:
    """Every paused queue, the oldest pause first, with who paused it, why and since when."""
    return [queue_pause_as_dict(pause) for pause in QueuePause.objects.order_by("since", "id")]


def job_wait_explain(job: Job, *, now=None) -> dict[str, Any]:
    """Why ``job`` is not executing yet, from the queue's own rules (in at most five queries).

    Returns ``waiting`` (whether it is in a waiting state at all), ``summary`` (one sentence),
    ``blockers`` (``[{"code", "detail"}]``, the most decisive first: ``not_queued``,
    ``awaiting_user_confirmation``, ``queue_paused`` (``paused`` says by whom, why and since when),
    ``no_worker``, ``delayed``, ``lane_held``, ``global_cap``,
    ``organization_cap``, ``behind``), the lane and the job holding it, ``position`` among the jobs a worker could
    claim now (1 = next; ``None`` when the job itself cannot be claimed now), ``jobs_ahead``, its
    priority and age, the caps in effect (lane and global concurrency, jobs executing), the
    aging guard and, when delayed, when it becomes eligible (``eligible_at``).
    """
    return jobs_wait_explain([job], now=now)[job.pk]


def _explain(job: Job, *, now, executing: list[dict], holders: dict[str, dict], streaks: dict[str, int],
             workers_alive: int, pause: QueuePause | None = None) -> dict[str, Any]:
    concurrency = settings.ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY
    burst = settings.ORCHESTRATOR_QUEUE_MAX_INTERACTIVE_BURST
    aging_ms = settings.ORCHESTRATOR_QUEUE_BACKGROUND_AGING_MS
    waiting_since = job.queued_at or job.created_at
    holder = holders.get(job.lane) if job.lane else None
    if holder is not None and holder["id"] == job.pk:
        holder = None
    explanation: dict[str, Any] = {
        "job": job.pk,
        "state": job.state,
        "waiting": job.state in NOT_STARTED_JOB_STATES,
        "priority": job.priority,
        "priority_class": job.priority_class,
        "age_s": _age_s(waiting_since, now),
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "lane": job.lane,
        "lane_holder": None if holder is None else {
            "id": holder["id"], "type": holder["type"], "worker": holder["worker"], "run": holder["run_id"],
            "age_s": _age_s(holder["started_at"], now),
            "timeout_at": (holder["started_at"] + timedelta(seconds=holder["timeout_s"])).isoformat()
            if holder["started_at"] and holder["timeout_s"] else None,
        },
        "caps": {"lane_concurrency": 1 if job.lane else None, "global_concurrency": concurrency,
                 "executing": len(executing), "free_slots": max(0, concurrency - len(executing))},
        "not_before": isoformat_or_none(job.not_before),
        "eligible_at": None,
        "eligible_in_s": None,
        "position": None,
        "jobs_ahead": None,
        "eligible_jobs": None,
        "aging": None,
        "workers_alive": workers_alive,
        "queue_enabled": bool(settings.ORCHESTRATOR_QUEUE_ENABLED),
        "paused": None if pause is None else queue_pause_as_dict(pause),
        "deadline_at": isoformat_or_none(job.deadline_at),
        "blockers": [],
        "summary": "",
    }
    blockers = explanation["blockers"]
    if not explanation["waiting"]:
        if job.state == JobState.EXECUTING:
            explanation["summary"] = f"Not waiting: executing on {job.worker or 'a worker'} since " \
                                     f"{_age_s(job.started_at, now)} s (attempt {job.attempts})."
        else:
            explanation["summary"] = f"Not waiting: {job.state}" + (f" ({job.reason})." if job.reason else ".")
        return explanation

    if job.priority_class == PriorityClass.BACKGROUND and job.lane:
        streak = streaks.get(job.lane, 0)
        aged_at = waiting_since + timedelta(milliseconds=aging_ms) if waiting_since else None
        explanation["aging"] = {
            "lane_interactive_streak": streak, "max_interactive_burst": burst, "aging_ms": aging_ms,
            "aged": bool(aged_at and aged_at <= now), "ages_in_s": _seconds_until(aged_at, now),
            "jumps_queue": bool(aged_at and aged_at <= now and streak >= burst),
        }

    if job.state == JobState.RECEIVED:
        blockers.append({"code": "not_queued", "detail": "received but not queued yet: no worker may claim it"})
    elif job.state == JobState.AWAITING_USER_CONFIRMATION:
        blockers.append({"code": "awaiting_user_confirmation",
                         "detail": "waits for a user's confirmation; workers do not claim it until then"})
    if pause is not None:
        blockers.append({"code": "queue_paused", "detail": f"the queue of its {pause.queue} is paused by "
                                                           f"{pause.actor_label} since {pause.since.isoformat()}: "
                                                           f"{pause.reason} (it keeps its place until resumed)"})
    if not workers_alive:
        blockers.append({"code": "no_worker", "detail": "no worker has sent a heartbeat within "
                                                        f"{worker_alive_window_s()} s: nothing claims jobs"})
    delayed = job.not_before is not None and job.not_before > now
    if delayed:
        explanation["eligible_at"] = job.not_before.isoformat()
        explanation["eligible_in_s"] = _seconds_until(job.not_before, now)
        why = "retry backoff after a failed attempt" if job.reason == JobReason.RETRY_SCHEDULED \
            else "its not_before time"
        blockers.append({"code": "delayed", "detail": f"delayed until {job.not_before.isoformat()} "
                                                      f"(in {explanation['eligible_in_s']} s): {why}"})
    if holder is not None:
        detail = (f"its lane {job.lane!r} is held by job {holder['id']} ({holder['type']}), executing for "
                  f"{explanation['lane_holder']['age_s']} s on {holder['worker'] or 'a worker'}; one job per lane "
                  "executes at a time")
        blockers.append({"code": "lane_held", "detail": detail})
    if len(executing) >= concurrency:
        blockers.append({"code": "global_cap", "detail": f"all {concurrency} concurrency slots are busy "
                                                         f"({len(executing)} jobs executing)"})
    organization_cap = organization_max_executing()
    organization_executing = sum(1 for row in executing if row["organization_id"] == job.organization_id)
    organization_capped = organization_cap < concurrency and organization_executing >= organization_cap
    if organization_capped:  # (at a cap as wide as the pool, the global cap is the one that binds)
        blockers.append({"code": "organization_cap", "detail": f"its organization has {organization_executing} "
                                                               f"jobs executing, its cap (other organizations' "
                                                               f"jobs are claimed meanwhile)"})

    if job.state in WAITING_JOB_STATES:
        aged = _aged_q(now)
        counts = jobs_eligible(now).aggregate(
            eligible=Count("id"),
            aged=Count("id", filter=aged),
            aged_ahead=Count("id", filter=aged & (Q(queued_at__lt=waiting_since)
                                                  | Q(queued_at=waiting_since, id__lt=job.pk))),
            ahead=Count("id", filter=~aged & _claim_ahead_q(job)),
        )
        job_is_aged = bool(explanation["aging"] and explanation["aging"]["jumps_queue"])
        ahead = counts["aged_ahead"] if job_is_aged else counts["aged"] + counts["ahead"]
        explanation["jobs_ahead"] = ahead
        explanation["eligible_jobs"] = counts["eligible"]
        claimable = not delayed and holder is None and not organization_capped and pause is None
        if claimable:
            explanation["position"] = ahead + 1
        if ahead:
            order = "aged background jobs of saturated lanes first, then lower priority, interactive first, FIFO"
            blockers.append({"code": "behind", "detail": f"{ahead} claimable job{'s' if ahead != 1 else ''} "
                                                        f"ahead of it in the claim order ({order})"})

    if not blockers:
        explanation["summary"] = "Claimable now and first in line: the next worker to look claims it."
    else:
        first = blockers[0]["detail"]
        explanation["summary"] = f"Waiting: {first[0].upper()}{first[1:]}" + (
            f" (and {len(blockers) - 1} more reason{'s' if len(blockers) > 2 else ''})." if len(blockers) > 1 else ".")
    return explanation


def run_jobs_not_started(*, run_id: int, limit: int) -> list[Job]:
    """A run's jobs that have not started yet, oldest first (at most ``limit``)."""
    return list(Job.objects.filter(run_id=run_id, state__in=NOT_STARTED_JOB_STATES).order_by("id")[:limit])


def maintenance_due(now) -> dict[str, bool]:
    """Which maintenance duties have work, in one statement of four indexed ``EXISTS`` probes:
    an executing job whose lease expired (``job_executing_lease_idx``), an active job past its
    deadline (``job_active_deadline_idx``), an executing job asked to stop, a waiting job
    (``job_claim_order_idx``). The duties' own scans run only when their probe says so."""
    probes = {
        "recover": Job.objects.filter(state=JobState.EXECUTING, lease_expires_at__lt=now),
        # the states as the partial indexes name them, in their order (``index_states``: SQLite)
        "deadlines": Job.objects.filter(state__in=index_states("job_active_deadline_idx"), deadline_at__lt=now),
        "interrupts": Job.objects.filter(state=JobState.EXECUTING, cancel_requested_at__isnull=False),
        "waiting": Job.objects.filter(state__in=index_states("job_claim_order_idx")),
    }
    return {name: bool(value) for name, value in subqueries_row(probes, wrap="EXISTS ({})", limit=1).items()}


def jobs_due_exist(now) -> bool:
    """Whether any job waits whose ``not_before`` has passed: one prepared ``EXISTS`` over the claim
    index (``job_claim_order_idx``), without the claim's lock or transaction. False: a claim now would
    find nothing; True: it may find something (the job's lane may be busy, its queue paused, every
    slot taken: the claim decides)."""
    with hot_cursor() as cursor:
        cursor.execute(_due_exist_sql(), [db().ops.adapt_datetimefield_value(now)])
        return bool(cursor.fetchone()[0])


@per_vendor
def _due_exist_sql() -> str:
    """``jobs_due_exist``' statement: the waiting states written out as the partial index names them."""
    conn = db()
    qn = conn.ops.quote_name
    states = ", ".join(f"'{state}'" for state in index_states("job_claim_order_idx"))
    state, not_before = (qn(Job._meta.get_field(name).column) for name in ("state", "not_before"))
    return (f"SELECT EXISTS (SELECT 1 FROM {qn(Job._meta.db_table)} j WHERE j.{state} IN ({states})"
            f" AND (j.{not_before} IS NULL OR j.{not_before} <= %s))")


def jobs_active_dedupe_keys(keys: list[str]) -> set[str]:
    """Of ``keys`` (``<type>:<dedupe key>``), those an active job holds: one prepared statement (an
    array parameter on PostgreSQL), for callers that look up many keys on a hot path."""
    if not keys:
        return set()
    postgres = db().vendor == "postgresql"
    with hot_cursor() as cursor:
        cursor.execute(_active_keys_sql(1 if postgres else len(keys)), [list(keys)] if postgres else list(keys))
        return {key for (key,) in cursor.fetchall()}


@per_vendor
def _active_keys_sql(count: int) -> str:
    """The active dedupe keys among a list (an array parameter on PostgreSQL, else ``count`` parameters)."""
    conn = db()
    qn = conn.ops.quote_name
    column = qn(Job._meta.get_field("active_dedupe_key").column)
    wanted = "= ANY(%s::text[])" if conn.vendor == "postgresql" else f"IN ({', '.join(['%s'] * count)})"
    return f"SELECT j.{column} FROM {qn(Job._meta.db_table)} j WHERE j.{column} {wanted}"
