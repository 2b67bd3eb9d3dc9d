"""Make the ledger append-only in the database itself (PostgreSQL).

A row-level trigger rejects every UPDATE and DELETE of ``billing_ledgerentry``. TRUNCATE is
left to the database owner (test databases are flushed with it). On SQLite the model layer
enforces the same rule.
"""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION billing_ledger_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION USING
        MESSAGE = 'billing_ledgerentry is append-only: ' || TG_OP || ' is not allowed',
        ERRCODE = 'insufficient_privilege';
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS billing_ledger_append_only ON billing_ledgerentry;
CREATE TRIGGER billing_ledger_append_only
    BEFORE UPDATE OR DELETE ON billing_ledgerentry
    FOR EACH ROW EXECUTE FUNCTION billing_ledger_append_only();
"""

DROP = """
DROP TRIGGER IF EXISTS billing_ledger_append_only ON billing_ledgerentry;
DROP FUNCTION IF EXISTS billing_ledger_append_only();
"""


def create_trigger(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop_trigger(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("billing", "0001_initial")]

    operations = [migrations.RunPython(create_trigger, drop_trigger)]
