"""More of the ledger's append-only rule in the database itself.

* PostgreSQL: a statement-level ``BEFORE TRUNCATE`` trigger (next to 0002's row-level
  UPDATE/DELETE trigger, same function): ``TRUNCATE billing_ledgerentry``, and a ``TRUNCATE …
  CASCADE`` that would reach it, is refused.
* SQLite: ``BEFORE UPDATE`` and ``BEFORE DELETE`` triggers that ``RAISE(ABORT, …)``.

No setting or session variable turns these off: only the table's owner can, by disabling or
dropping the trigger (DDL, which shows in the database's own logs). The test suite does exactly
that around the flush Django runs between transactional tests (``tests/ledger_guard.py``); no
code of the application does. A later migration that makes Django rebuild this table on SQLite
(a "remake": most column changes) drops its triggers and must create them again;
``tests/billing/test_append_only.py`` fails until it does.
"""

from django.db import migrations

POSTGRES_CREATE = """
DROP TRIGGER IF EXISTS billing_ledger_no_truncate ON billing_ledgerentry;
CREATE TRIGGER billing_ledger_no_truncate
    BEFORE TRUNCATE ON billing_ledgerentry
    FOR EACH STATEMENT EXECUTE FUNCTION billing_ledger_append_only();
"""

POSTGRES_DROP = "DROP TRIGGER IF EXISTS billing_ledger_no_truncate ON billing_ledgerentry;"

SQLITE_CREATE = [
    """CREATE TRIGGER IF NOT EXISTS billing_ledger_no_update BEFORE UPDATE ON billing_ledgerentry
    BEGIN SELECT RAISE(ABORT, 'billing_ledgerentry is append-only: UPDATE is not allowed'); END""",
    """CREATE TRIGGER IF NOT EXISTS billing_ledger_no_delete BEFORE DELETE ON billing_ledgerentry
    BEGIN SELECT RAISE(ABORT, 'billing_ledgerentry is append-only: DELETE is not allowed'); END""",
]

SQLITE_DROP = [
    "DROP TRIGGER IF EXISTS billing_ledger_no_update",
    "DROP TRIGGER IF EXISTS billing_ledger_no_delete",
]


def create_triggers(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(POSTGRES_CREATE)
    elif vendor == "sqlite":
        for statement in SQLITE_CREATE:
            schema_editor.execute(statement)


def drop_triggers(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(POSTGRES_DROP)
    elif vendor == "sqlite":
        for statement in SQLITE_DROP:
            schema_editor.execute(statement)


class Migration(migrations.Migration):
    dependencies = [("billing", "0004_ledger_keyed_chain")]

    operations = [migrations.RunPython(create_triggers, drop_triggers)]
