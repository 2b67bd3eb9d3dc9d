"""The planner's statistics of the tables the hot paths write and read by key (PostgreSQL).

A prepared statement runs on a generic plan made once per connection, from the statistics its
tables had then, and made again only when they change. Plans made while a table was empty or
tiny (a fresh database, the first runs of the day) read it whole, or by the state column rather
than the primary key: a step's settlement then scans every pending step of every run, the run's
lock and its foreign-key checks scan every run, and each step costs more as the tables grow.
autovacuum keeps the statistics current where it runs and keeps up; ``statistics_refresh`` does
it anyway for the registered tables (each app registers its own in ``ready()``), called by the
workers' maintenance: one catalog read per interval, an ``ANALYZE`` (a sample of each table) only
of the tables that grew (or shrank) by half since their statistics were taken, or, for a table
registered with ``churn`` (a queue, whose rows' states are what its plans depend on), of which
enough rows changed, at most once per ``STATISTICS_CHURN_INTERVAL_S``. Taking them again also
makes every connection plan its statements on these tables afresh, so the rules keep it rare: a
few times in a table's first minutes, about once per doubling after, and for a queue that turns
over its rows every second or two (a few thousand rows, thousands of jobs a second) twice a minute.
"""

from __future__ import annotations

import logging

from django.db import DatabaseError, connection, transaction
from django.db.models import Model

logger = logging.getLogger("orchestrator.planner")

# The tables kept current: models, registered by their apps, and whether their rows' changes count.
STATISTICS_TABLES: dict[type[Model], bool] = {}

# When a table's statistics are taken again: when it holds STATISTICS_GROWTH times more rows than
# they say, or that many times fewer (and at least STATISTICS_MIN_GROWTH rows more or fewer: a
# plan made for a table of 10 rows reads a table of 10,000 the wrong way); for a ``churn`` table
# also when STATISTICS_CHANGED_SHARE of its rows (at least STATISTICS_MIN_CHANGES) were inserted,
# updated or deleted since (what they say of its values is behind: the queue's states).
STATISTICS_GROWTH = 2.0
STATISTICS_MIN_GROWTH = 100
STATISTICS_CHANGED_SHARE = 0.2
STATISTICS_MIN_CHANGES = 1_000
# The churn rule fires for a table at most once in this many seconds (since its last ANALYZE, ours or
# autovacuum's): a queue of a few thousand rows at 1,500 jobs/s changed a fifth of them between two
# checks, and its ANALYZE (100 ms of a core, at every check) and the plans every connection then made
# again cost the workers more than statistics a few seconds older would. The growth rule has no floor.
STATISTICS_CHURN_INTERVAL_S = 30
# How long an ANALYZE waits for a table's lock (held by a migration, a VACUUM) before it gives up.
STATISTICS_LOCK_TIMEOUT_MS = 1_000


def statistics_tables_register(*models: type[Model], churn: bool = False) -> None:
    """Keep the planner's statistics of ``models``' tables current (``statistics_refresh``);
    ``churn``: also once enough of their rows changed, not only when they grew."""
    for model in models:
        STATISTICS_TABLES[model] = STATISTICS_TABLES.get(model, False) or churn


def statistics_refresh() -> list[str]:
    """``ANALYZE`` the registered tables whose statistics are behind them (PostgreSQL: the rules
    above; never taken counts as taken of an empty table, so a table of STATISTICS_MIN_GROWTH rows
    is analyzed the first time). Returns the tables analyzed, in one statement; none where the
    server refuses (not their owner, say: the planner keeps what autovacuum gives it)."""
    if connection.vendor != "postgresql" or not STATISTICS_TABLES:
        return []
    tables = [model._meta.db_table for model in STATISTICS_TABLES]
    churn = [model._meta.db_table for model, changes in STATISTICS_TABLES.items() if changes]
    try:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT s.relname FROM pg_stat_user_tables s INNER JOIN pg_class c ON c.oid = s.relid,"
                " LATERAL (SELECT GREATEST(c.reltuples, 0) AS taken) t"
                " WHERE s.relid = ANY(%(tables)s::regclass[])"
                " AND ((abs(s.n_live_tup - t.taken) >= %(growth_min)s"
                "       AND (s.n_live_tup >= %(growth)s * t.taken OR s.n_live_tup * %(growth)s <= t.taken))"
                "   OR (s.relid = ANY(%(churn)s::regclass[])"
                "       AND s.n_mod_since_analyze >= GREATEST(%(changes)s, %(share)s * s.n_live_tup)"
                "       AND COALESCE(GREATEST(s.last_analyze, s.last_autoanalyze) < now() - %(floor)s * interval '1 s',"
                "                    true)))"
                " ORDER BY s.relname",
                {"tables": tables, "churn": churn, "growth": STATISTICS_GROWTH, "growth_min": STATISTICS_MIN_GROWTH,
                 "changes": STATISTICS_MIN_CHANGES, "share": STATISTICS_CHANGED_SHARE,
                 "floor": STATISTICS_CHURN_INTERVAL_S})
            behind = [row[0] for row in cursor.fetchall()]
        if behind:
            with transaction.atomic(), connection.cursor() as cursor:
                # A migration holding a table's lock makes the ANALYZE give up, not wait with the
                # worker's heartbeat thread, which runs the maintenance.
                cursor.execute("SELECT set_config('lock_timeout', %s, true)", [f"{STATISTICS_LOCK_TIMEOUT_MS}ms"])
                cursor.execute(f"ANALYZE {', '.join(connection.ops.quote_name(table) for table in behind)}")
    except DatabaseError:
        if not _refused:  # said once per process: the check runs every few seconds
            logger.warning("could not refresh the planner's statistics", exc_info=True)
        _refused.append(True)
        return []
    return behind


_refused: list[bool] = []
