"""The ledger's hash chain: keyed digests, and the seal over entries hashed before keys.

Each entry's ``entry_hash`` is HMAC-SHA256, under the ledger key, of its content and the
previous entry's hash (``LedgerEntry.hash_body``). Without the key nobody can recompute a
chain that ``check_invariants`` accepts, so rewriting a row and re-chaining the rows after it
(with plain SHA-256 or a guessed key) is detected like any other change.

The key is ``settings.ORCHESTRATOR_LEDGER_HMAC_KEY`` or, when that is empty, HMAC-SHA256 of
the fixed label ``orchestrator.ledger-chain`` under ``SECRET_KEY``. Settings are read when a
digest is computed, never at import. Changing the key (or ``SECRET_KEY`` while the ledger key
is derived from it) makes every existing entry fail the check.

Entries written before the chain was keyed carry plain SHA-256 digests. Migration
``0004_ledger_keyed_chain`` records, per organization, the newest such entry
(``CreditAccount.legacy_chain_end``) and seals that boundary with the key
(``legacy_chain_seal``): entries up to the boundary are verified with SHA-256, every later one
with the key, and moving the boundary needs the key. A fresh install has no legacy entries.
"""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings

KEY_LABEL = b"orchestrator.ledger-chain"


def chain_key() -> bytes:
    """The ledger key, read from the settings now."""
    configured = getattr(settings, "ORCHESTRATOR_LEDGER_HMAC_KEY", "") or ""
    if configured:
        return configured.encode()
    secret = settings.SECRET_KEY
    return hmac.new(secret.encode() if isinstance(secret, str) else bytes(secret), KEY_LABEL,
                    hashlib.sha256).digest()


def entry_digest(body: bytes, *, key: bytes | None = None) -> str:
    """HMAC-SHA256 of an entry's hash body under ``key`` (default: the ledger key)."""
    return hmac.new(chain_key() if key is None else key, body, hashlib.sha256).hexdigest()


def legacy_entry_digest(body: bytes) -> str:
    """The unkeyed digest of entries written before the chain was keyed."""
    return hashlib.sha256(body).hexdigest()


def legacy_seal(*, organization_id: int, entry_id: int, entry_hash: str, key: bytes | None = None) -> str:
    """The keyed seal over an organization's newest unkeyed entry."""
    message = f"legacy-chain-end:{organization_id}:{entry_id}:{entry_hash}".encode()
    return hmac.new(chain_key() if key is None else key, message, hashlib.sha256).hexdigest()
