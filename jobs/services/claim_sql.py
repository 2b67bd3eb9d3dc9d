"""The batch claim statement, built once per process and database vendor.

One ``UPDATE ... FROM <chosen> RETURNING`` does the whole claim (``jobs_claim``):

1. ``aged`` and ``fresh``: the first ``CANDIDATES`` eligible jobs in each of the two claim
   orders (aged background jobs of a ``saturated`` lane, oldest first; every eligible job by
   priority, class, FIFO), each an index scan with ``LIMIT`` and, on PostgreSQL, ``FOR UPDATE
   SKIP LOCKED`` (a row another transaction holds is passed over);
2. ``ranked``: one claim order over both lists (aged first; a job in both keeps its first place);
   among the fresh candidates of one priority and class, a job of a type that shares the workers
   between runs (``spread_runs``) whose run has a job executing comes after the others (``busy``:
   an index probe of the run's jobs), so the look-ahead is bounded by the candidates;
3. ``lanes``: the first job of each lane (jobs without a lane each stand alone);
4. ``in_organization`` and ``organization_free``: the n-th job of an organization gets the
   organization's n-th free slot (none free: the job stays queued);
5. ``chosen``: the n-th remaining job gets the n-th free global slot, at most ``batch`` jobs; a job
   whose type is claimed alone (``claim_alone``) only heads a batch of one (the batch ends before it);
6. on PostgreSQL, ``claimed``, ``events`` and ``streaks``: the claimed rows' events are inserted
   (their payloads built as ``job_as_dict`` builds them) and their lanes' interactive streaks
   updated by the same statement, so the claim lock is not held over another round trip.

Slots are handed out in claim order (the lowest first), so ordering the claimed rows by slot
gives the claim order back. Every constant of the statement (the waiting states, the number of
candidates) is written into its text, so the partial claim index matches a generic plan too
(PostgreSQL plans a prepared statement generically after five executions); the settings (caps,
burst, lease) are parameters, because they may change while the process runs.
"""

from __future__ import annotations

import zlib

from django.db import connection

from core.models import Event
from jobs.events import JOB_STATE_EVENTS
from jobs.models import WAITING_JOB_STATES, Job, JobLane, JobState, PriorityClass, QueuePause, index_states
from jobs.registry import claim_alone_types, spread_runs_types
from jobs.services.common import _job_columns

# The key of the transaction-scoped advisory lock every claim takes on PostgreSQL.
CLAIM_LOCK_KEY = zlib.crc32(b"orchestrator.jobs.claim")
# Rows read (and locked) from each claim order per statement: the batch and a quarter more, at
# least this many, enough for a batch when a few lanes are busy; a claim finding fewer takes fewer.
# (Twice the batch locked 64 rows for a batch of 32, each lock a write of its row and a WAL record,
# under the claim lock, and gave the other 32 back at the commit.)
CANDIDATES = 16


def _candidates(limit: int) -> int:
    return max(CANDIDATES, limit + limit // 4)


_SQL: dict[tuple[str, int], str] = {}


def claim_sql(limit: int) -> str:
    """The claim statement for this connection's vendor (``limit`` only widens the candidates)."""
    candidates = _candidates(limit)
    alone, spread = claim_alone_types(), spread_runs_types()
    key = (connection.vendor, candidates, alone, spread)
    if key not in _SQL:
        _SQL[key] = _build(candidates, skip_locked=connection.features.has_select_for_update_skip_locked,
                           alone=alone, spread=spread, events_inline=events_inline(),
                           picked=connection.vendor == "postgresql")
    return _SQL[key]


# The claim lock, and sorts and sequential scans off for the statements after it in this transaction
# only: the pick (``fresh_sql``, which turns sorts back on) and the claim statement (their filters
# then read the indexes of executing jobs, and the aged jobs' lanes theirs, even under a generic
# plan or one made while the table was empty); and their generic plans, always: those settings leave
# them one shape of plan, and PostgreSQL's own choice between a generic and a custom plan (made
# again once the job table's statistics change) went to custom plans for about half the claims of
# two clusters, each planned anew under the claim lock (about 1 ms for the claim statement, a third
# of its time). Returns the settings it replaced, for a claim inside a caller's transaction to give
# back (``RESTORE_SQL``).
LOCK_SQL = ("SELECT pg_advisory_xact_lock(%s), current_setting('enable_sort'), current_setting('enable_seqscan'),"
            " current_setting('plan_cache_mode'), set_config('enable_sort', 'off', true),"
            " set_config('enable_seqscan', 'off', true), set_config('plan_cache_mode', 'force_generic_plan', true)")


RESTORE_SQL = "SELECT set_config('enable_seqscan', %s, true), set_config('plan_cache_mode', %s, true)"

# Where the pick leaves the ids it picked for the claim statement of its transaction (a setting
# local to the transaction), so the two need no round trip to the client in between.
PICKED_SETTING = "orchestrator.claim_picked"


def fresh_sql(limit: int) -> str:
    """PostgreSQL's pick of the fresh candidates, before the claim statement (which then reads them
    by id from ``PICKED_SETTING``): the ids of the first eligible jobs in the claim order (locked),
    and sorts given back (``%(sort)s``: what ``LOCK_SQL`` returned) for the statements after it.

    A queue table's statistics are always behind it (thousands of rows enqueued between two
    ANALYZEs), and the planner cannot estimate the eligibility filters (a half each, it guesses):
    within the claim statement it read every waiting job and sorted them rather than walking the
    claim index, so a claim cost in proportion to the depth of the queue (15 ms at 20,000 waiting
    jobs, the claim lock held all along). Planned with sorts off, the pick's only plan is the claim
    index in order, stopping at the limit, whatever the statistics say."""
    candidates = _candidates(limit)
    key = ("fresh", connection.vendor, candidates)
    if key not in _SQL:
        qn = connection.ops.quote_name
        _SQL[key] = (
            "SELECT set_config('enable_sort', %(sort)s, true), array_agg(f.id),"
            f" set_config({_literal(PICKED_SETTING)}, COALESCE(array_agg(f.id), '{{}}')::text, true) FROM"
            f" (SELECT j.id FROM {qn(Job._meta.db_table)} j WHERE {_eligible()}"
            f" ORDER BY j.priority, j.class_rank, j.id LIMIT {candidates} FOR UPDATE OF j SKIP LOCKED) f"
        )
    return _SQL[key]


def events_inline() -> bool:
    """Whether the claim statement writes the claimed jobs' events itself (PostgreSQL: a data-modifying
    ``WITH``), so the claim lock is not held over one more round trip; elsewhere ``jobs_claim``
    writes them after the statement."""
    return connection.vendor == "postgresql"


def _literal(value: str) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def _claim_index_states() -> list[str]:
    """The waiting states as the claim index's condition lists them (``job_claim_order_idx``):
    SQLite uses a partial index only for a query whose condition is written as the index's, in the
    same order (the states sorted otherwise, it read and sorted the whole job table at every claim)."""
    states = index_states("job_claim_order_idx")
    assert set(states) == set(WAITING_JOB_STATES), "the claim index must cover exactly the waiting states"
    return states


def _indexed_by(index: str) -> str:
    """SQLite's ``INDEXED BY``: its planner, whose statistics say nearly every job has one state
    (they are mostly completed), would otherwise scan a whole index of the job table for the few
    executing jobs, at every claim; the query's condition implies the partial index's. Nothing elsewhere."""
    return f" INDEXED BY {connection.ops.quote_name(index)}" if connection.vendor == "sqlite" else ""


def _eligible() -> str:
    """The claim's test of a waiting job (alias ``j``): past ``not_before``, its lane idle, its
    organization below its executing cap, its queues not paused. The executing jobs are read
    through the partial indexes that hold only them."""
    qn = connection.ops.quote_name
    job, pause = qn(Job._meta.db_table), qn(QueuePause._meta.db_table)
    waiting = ", ".join(_literal(state) for state in _claim_index_states())
    executing = _literal(JobState.EXECUTING)
    return (
        f"j.state IN ({waiting})"
        " AND (j.not_before IS NULL OR j.not_before <= %(now)s)"
        f" AND NOT (j.lane IN (SELECT b.lane FROM {job} b{_indexed_by('job_one_executing_per_lane')}"
        f" WHERE b.state = {executing} AND NOT (b.lane = '')))"
        f" AND NOT (j.organization_id IN (SELECT o.organization_id FROM {job} o"
        f"{_indexed_by('job_one_executing_per_organization_slot')} WHERE o.state = {executing}"
        " GROUP BY o.organization_id HAVING COUNT(*) >= %(organization_cap)s))"
        # a paused queue (its project's or its type's): passed over, its jobs keep their place. Two
        # hashed filters, not an anti-join: the planner keeps walking the claim index in order.
        f" AND NOT (j.project_id IN (SELECT p.project_id FROM {pause} p WHERE p.project_id IS NOT NULL))"
        f" AND NOT (j.type IN (SELECT p.job_type FROM {pause} p WHERE p.job_type <> ''))"
    )


def _busy_run(spread: tuple[str, ...]) -> str:
    """1 for a candidate (alias ``j``) of a type in ``spread`` whose run has a job executing, else 0."""
    if not spread:
        return "0"
    job = connection.ops.quote_name(Job._meta.db_table)
    names = ", ".join(_literal(name) for name in spread)
    return (f"CASE WHEN j.type IN ({names}) AND EXISTS (SELECT 1 FROM {job} e WHERE e.run_id = j.run_id"
            f" AND e.state = {_literal(JobState.EXECUTING)}) THEN 1 ELSE 0 END")


def _build(candidates: int, *, skip_locked: bool, alone: tuple[str, ...] = (), spread: tuple[str, ...] = (),
           events_inline: bool = False, picked: bool = False) -> str:
    qn = connection.ops.quote_name
    job, lane = qn(Job._meta.db_table), qn(JobLane._meta.db_table)
    executing = _literal(JobState.EXECUTING)
    lock = " FOR UPDATE OF j SKIP LOCKED" if skip_locked else ""
    eligible = _eligible()
    busy = _busy_run(spread)
    columns = _job_columns()
    # The saturated lanes and the free slots are computed once per statement: inlined (PostgreSQL's
    # default for a CTE read once), the free slots are computed again for every chosen job, and the
    # aged jobs are looked for among all waiting jobs instead of in the (usually no) saturated lanes.
    materialized = "MATERIALIZED " if connection.vendor == "postgresql" else ""
    # A job that runs long (``JobDefinition.claim_alone``) is claimed alone, at the head of a batch of
    # one: a batch stops before the first such job after its head (left queued for the next claim),
    # and a batch whose head is one holds nothing else.
    head = ""
    if alone:
        names = ", ".join(_literal(name) for name in alone)
        head = (" AND (c.n = 1 OR c.n < (SELECT COALESCE(MIN(o.n), c.n + 1) FROM organization_ok o"
                f" WHERE o.type IN ({names})))")
    # The slot numbers looked at: the n-th free slot (global, or an organization's) is at most the
    # number of executing jobs plus n - 1, so the series stops there, below the caps (``span``): a
    # claim reads a few dozen numbers against the executing jobs' slots, not every number up to a cap.
    least = "LEAST" if connection.vendor == "postgresql" else "MIN"
    executing_count = (f"(SELECT COUNT(*) FROM {job} x{_indexed_by('job_one_executing_per_slot')}"
                       f" WHERE x.state = {executing})")
    return (
        "WITH RECURSIVE series(s) AS (SELECT 0 UNION ALL SELECT s + 1 FROM series"
        f" WHERE s + 1 < {least}(%(span)s, {executing_count} + %(batch)s)),"
        # from the saturated lanes (few; their index) to their waiting jobs (the lane index)
        f" saturated AS {materialized}(SELECT l.{qn('key')} AS lane FROM {lane} l"
        " WHERE l.interactive_streak >= %(burst)s),"
        # (a CROSS JOIN keeps SQLite's loop over the saturated lanes outside: joined the other way,
        # it read every job of the lane index; with no saturated lane, the usual case, the EXISTS is a
        # one-time filter and no job is read: PostgreSQL's plan scanned every waiting job first, then
        # joined them with the lanes, 1 ms a claim at 5,000 waiting jobs)
        f" aged AS (SELECT j.id, j.lane, j.organization_id, j.type, j.queued_at FROM saturated l"
        f" CROSS JOIN {job} j{_indexed_by('job_lane_state_idx')} WHERE EXISTS (SELECT 1 FROM saturated)"
        f" AND j.lane = l.lane AND NOT (j.lane = '') AND {eligible}"
        f" AND j.priority_class = {_literal(PriorityClass.BACKGROUND)} AND j.queued_at <= %(aging)s"
        f" ORDER BY j.queued_at, j.id LIMIT {candidates}{lock}),"
        + (f" fresh AS (SELECT j.id, j.lane, j.organization_id, j.type, j.priority, j.class_rank,"
           f" {busy} AS busy FROM {job} j WHERE j.id = ANY(NULLIF(current_setting({_literal(PICKED_SETTING)}, true),"
           " '')::bigint[])),"
           if picked else
           f" fresh AS (SELECT j.id, j.lane, j.organization_id, j.type, j.priority, j.class_rank,"
           f" {busy} AS busy FROM {job} j WHERE {eligible} ORDER BY j.priority, j.class_rank, j.id LIMIT {candidates}{lock}),")
        +
        " candidates AS (SELECT id, lane, organization_id, type, 0 AS grp,"
        " ROW_NUMBER() OVER (ORDER BY queued_at, id) AS pos FROM aged"
        " UNION ALL SELECT id, lane, organization_id, type, 1 AS grp,"
        " ROW_NUMBER() OVER (ORDER BY priority, class_rank, busy, id) AS pos FROM fresh),"
        " ranked AS (SELECT id, lane, organization_id, type, ROW_NUMBER() OVER (ORDER BY grp, pos) AS claim_rank,"
        " ROW_NUMBER() OVER (PARTITION BY id ORDER BY grp, pos) AS copy FROM candidates),"
        " lanes AS (SELECT id, organization_id, type, claim_rank, ROW_NUMBER() OVER (PARTITION BY lane,"
        " CASE WHEN lane = '' THEN id ELSE 0 END ORDER BY claim_rank) AS in_lane FROM ranked WHERE copy = 1),"
        " in_organization AS (SELECT id, organization_id, type, claim_rank,"
        " ROW_NUMBER() OVER (PARTITION BY organization_id ORDER BY claim_rank) AS n FROM lanes WHERE in_lane = 1),"
        f" organization_free AS {materialized}(SELECT o.organization_id, s.s AS organization_slot,"
        " ROW_NUMBER() OVER (PARTITION BY o.organization_id ORDER BY s.s) AS n"
        " FROM (SELECT DISTINCT organization_id FROM in_organization) o CROSS JOIN series s"
        f" WHERE s.s < %(organization_cap)s AND NOT EXISTS (SELECT 1 FROM {job} e WHERE e.state = {executing}"
        " AND e.organization_id = o.organization_id AND e.organization_slot = s.s)),"
        " organization_ok AS (SELECT c.id, c.type, f.organization_slot, ROW_NUMBER() OVER (ORDER BY c.claim_rank) AS n"
        " FROM in_organization c JOIN organization_free f"
        " ON f.organization_id = c.organization_id AND f.n = c.n),"
        + _free_and_chosen(job, executing, head)
        + (" , claimed AS (" if events_inline else "")
        + f" UPDATE {job} SET state = {executing}, reason = '', attempts = attempts + 1, slot = chosen.slot,"
        " organization_slot = chosen.organization_slot, worker = %(worker)s, not_before = NULL,"
        " started_at = COALESCE(started_at, %(now)s), lease_expires_at = %(lease)s, updated_at = %(touched)s"
        f" FROM chosen WHERE {job}.id = chosen.id RETURNING {columns}"
        + (f"), events AS ({_events_insert()}), streaks AS ({_streaks_update()}) SELECT * FROM claimed"
           if events_inline else "")
    )


def _free_and_chosen(job: str, executing: str, head: str) -> str:
    """``free`` (the free global slots, the lowest first) and ``chosen`` (the n-th job of
    ``organization_ok`` with the n-th of them). On PostgreSQL the free slots are one array, which
    each chosen job indexes: joined as rows, every chosen job read all of them (a nested loop of
    batch × cap rows, a sixth of the statement's time at a batch of 32 and a cap of 128)."""
    free = (f" WHERE s.s < %(global_cap)s AND NOT EXISTS (SELECT 1 FROM {job} e WHERE e.state = {executing}"
            " AND e.slot = s.s)")
    if connection.vendor == "postgresql":
        return (f" free AS MATERIALIZED (SELECT array_agg(s.s ORDER BY s.s) AS slots FROM series s{free}),"
                " chosen AS (SELECT c.id, c.organization_slot, f.slots[c.n] AS slot FROM organization_ok c"
                f" CROSS JOIN free f WHERE c.n <= %(batch)s AND c.n <= cardinality(f.slots){head})")
    return (f" free AS (SELECT s.s AS slot, ROW_NUMBER() OVER (ORDER BY s.s) AS n FROM series s{free}),"
            " chosen AS (SELECT c.id, c.organization_slot, f.slot FROM organization_ok c JOIN free f ON f.n = c.n"
            f" WHERE c.n <= %(batch)s{head})")


def _streaks_update() -> str:
    """The aging guard's count of each claimed job's lane (as ``claim._lanes_streak``): an interactive
    job adds one to its lane's streak, a background job resets it (a batch holds at most one job per
    lane, so no lane row is updated twice)."""
    qn = connection.ops.quote_name
    lane = qn(JobLane._meta.db_table)
    return (f"UPDATE {lane} l SET interactive_streak = CASE WHEN c.priority_class = "
            f"{_literal(PriorityClass.INTERACTIVE)} THEN l.interactive_streak + 1 ELSE 0 END,"
            f" updated_at = %(touched)s FROM claimed c WHERE l.{qn('key')} = c.lane AND c.lane <> ''")


def _iso(column: str) -> str:
    """SQL writing a timestamp as Python's ``datetime.isoformat()`` writes an aware UTC one
    (``core.timefmt.isoformat_or_none``): microseconds only when not zero, ``+00:00``."""
    utc = f"({column} AT TIME ZONE 'UTC')"
    return (f"CASE WHEN {column} IS NULL THEN NULL ELSE to_char({utc}, 'YYYY-MM-DD\"T\"HH24:MI:SS')"
            f" || CASE WHEN date_part('microseconds', {utc})::bigint %% 1000000 = 0 THEN ''"
            f" ELSE to_char({utc}, '.US') END || '+00:00' END")


def _events_insert() -> str:
    """The claimed jobs' events, in claim order (the slots were handed out in it)."""
    return job_events_insert(JobState.EXECUTING, source="claimed", order="c.slot")


def job_events_insert(state: str, *, source: str, order: str) -> str:
    """An ``INSERT`` of the events of the jobs a statement moved to ``state``: ``source`` names the
    part of its ``WITH`` that returns their rows (alias ``c``), each event's payload is
    ``job_as_dict`` of the row, built by the statement, and their ids increase in ``order``."""
    qn = connection.ops.quote_name
    event = qn(Event._meta.db_table)
    payload = (
        "jsonb_build_object('jobId', c.id, 'projectId', c.project_id, 'jobType', c.type, 'state', c.state,"
        " 'reason', c.reason, 'priority', c.priority_class, 'lane', c.lane, 'attempts', c.attempts,"
        f" 'maxAttempts', c.max_attempts, 'createdAt', {_iso('c.created_at')}, 'startedAt', {_iso('c.started_at')},"
        f" 'completedAt', {_iso('c.completed_at')}, 'error', NULLIF(c.error, ''), 'result', c.result)"
        " || jsonb_strip_nulls(jsonb_build_object('sourceSessionId', NULLIF(c.source_session_id, ''),"
        " 'threadId', NULLIF(c.thread_id, ''), 'runId', NULLIF(c.run_id, 0)))"
    )
    return (f"INSERT INTO {event} (type, organization_id, project_id, run_id, payload, created_at)"
            f" SELECT {_literal(JOB_STATE_EVENTS[state])}, c.organization_id, c.project_id, c.run_id,"
            f" {payload}, %(touched)s FROM {source} c ORDER BY {order}")
