"""Key the ledger's hash chain (HMAC-SHA256, ``billing.chain``) and seal what came before.

Entries are append-only, so entries written before this migration keep their plain SHA-256
hashes: re-hashing them would mean rewriting rows, and would bless any change an attacker had
already hidden under the unkeyed scheme. Instead, for every organization with entries, the
newest one is recorded as the end of its unkeyed chain (``legacy_chain_end``) and that boundary
is sealed with the ledger key (``legacy_chain_seal``). ``check_invariants`` verifies entries up
to the boundary with SHA-256 and every later entry with the key; moving the boundary (to pass
off a re-chained entry as unkeyed) needs the key. On a fresh install there is nothing to seal.
"""

from django.db import migrations, models
from django.db.models import Max


def seal_unkeyed_chains(apps, schema_editor):
    from billing.chain import chain_key, legacy_seal

    CreditAccount = apps.get_model("billing", "CreditAccount")
    LedgerEntry = apps.get_model("billing", "LedgerEntry")
    database = schema_editor.connection.alias
    newest = (LedgerEntry.objects.using(database).values("organization_id").annotate(end=Max("id"))
              .values_list("organization_id", "end"))
    key = None
    for organization_id, end in newest:
        key = key or chain_key()
        end_hash = LedgerEntry.objects.using(database).values_list("entry_hash", flat=True).get(pk=end)
        CreditAccount.objects.using(database).filter(organization_id=organization_id).update(
            legacy_chain_end=end,
            legacy_chain_seal=legacy_seal(organization_id=organization_id, entry_id=end, entry_hash=end_hash,
                                          key=key))


class Migration(migrations.Migration):
    dependencies = [("billing", "0003_ledger_direct_charges")]

    operations = [
        migrations.AddField(
            model_name="creditaccount",
            name="legacy_chain_end",
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name="creditaccount",
            name="legacy_chain_seal",
            field=models.CharField(blank=True, default="", max_length=64),
        ),
        migrations.RunPython(seal_unkeyed_chains, migrations.RunPython.noop),
    ]
