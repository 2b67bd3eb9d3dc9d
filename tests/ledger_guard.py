"""Lifting the ledger's append-only triggers, for the test suite only.

Between transactional tests Django empties every table (``flush``): ``TRUNCATE`` on PostgreSQL,
``DELETE FROM`` on SQLite, both refused on ``billing_ledgerentry`` by its triggers (billing
migrations 0002 and 0005). ``flush_lifting_ledger_triggers`` wraps Django's flush so that, in
the flush's own transaction, the triggers are disabled (PostgreSQL) or dropped (SQLite) before
the tables are emptied and restored right after: DDL that only the table's owner may run, and
that no code of the application runs. Tests that tamper with the ledger on purpose use
``ledger_triggers_lifted`` inside their own transaction (rolled back with it).
"""

from __future__ import annotations

import contextlib

from django.db.backends.base.operations import BaseDatabaseOperations

LEDGER_TABLE = "billing_ledgerentry"


def _sqlite_triggers(connection) -> list[tuple[str, str]]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND tbl_name = %s ORDER BY name",
                       [LEDGER_TABLE])
        return list(cursor.fetchall())


def lift_sql(connection) -> tuple[list[str], list[str]]:
    """``(before, after)``: statements that lift the ledger's triggers and put them back."""
    if connection.vendor == "postgresql":
        return ([f"ALTER TABLE {LEDGER_TABLE} DISABLE TRIGGER USER"],
                [f"ALTER TABLE {LEDGER_TABLE} ENABLE TRIGGER USER"])
    if connection.vendor == "sqlite":
        triggers = _sqlite_triggers(connection)
        return [f'DROP TRIGGER "{name}"' for name, _ in triggers], [sql for _, sql in triggers]
    return [], []


@contextlib.contextmanager
def ledger_triggers_lifted(connection):
    """Inside a transaction the caller rolls back: the ledger's triggers are off until the end."""
    before, after = lift_sql(connection)
    if connection.vendor == "postgresql":  # ALTER TABLE refuses to run with deferred FK checks pending
        before, after = ["SET CONSTRAINTS ALL IMMEDIATE", *before], [*after, "SET CONSTRAINTS ALL DEFERRED"]
    with connection.cursor() as cursor:
        for statement in before:
            cursor.execute(statement)
    yield
    with connection.cursor() as cursor:
        for statement in after:
            cursor.execute(statement)


_original_execute_sql_flush = BaseDatabaseOperations.execute_sql_flush


# A flush waits for every other session's locks on the tables it empties; a session a test left
# inside a transaction would hold it forever. It gives up after this long and names the sessions.
FLUSH_LOCK_TIMEOUT = "60s"


def _execute_sql_flush(self, sql_list):
    if any(LEDGER_TABLE in sql for sql in sql_list):
        before, after = lift_sql(self.connection)
        sql_list = [*before, *sql_list, *after]
    if self.connection.vendor != "postgresql":
        return _original_execute_sql_flush(self, sql_list)
    try:
        return _original_execute_sql_flush(self, [f"SET LOCAL lock_timeout = '{FLUSH_LOCK_TIMEOUT}'", *sql_list])
    except Exception as error:
        if "lock timeout" not in str(error):
            raise
        raise RuntimeError(f"the flush between tests waited {FLUSH_LOCK_TIMEOUT} for these sessions' locks: "
                           f"{_other_sessions(self.connection)}") from error


def _other_sessions(connection) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid, application_name, state, backend_xid IS NOT NULL, left(query, 200)"
                       " FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")
        return list(cursor.fetchall())


def flush_lifting_ledger_triggers() -> None:
    """Make Django's flush (between transactional tests) lift the ledger's triggers."""
    BaseDatabaseOperations.execute_sql_flush = _execute_sql_flush
