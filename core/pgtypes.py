"""PostgreSQL's values read back: the loaders every new connection starts with."""

from __future__ import annotations

from datetime import datetime

from django.db import connections


def timestamps_parsed_fast() -> None:
    """PostgreSQL: read ``timestamptz`` values (every row's ``created_at``, a run tree's dozens) with
    the standard library's C parser rather than Django's loader, which subclasses psycopg's pure
    Python one (3.6 µs a value against 1). Same values: the session's time zone's text, the zone
    Django's loader puts on them; any text the fast parser refuses (a BC date, a year past 9999,
    ``infinity``) goes to Django's loader as before. Registered on the adapters every new
    connection of each PostgreSQL database starts from."""
    from django.conf import settings

    for alias in connections:
        conn = connections[alias]
        if conn.vendor != "postgresql":
            continue
        from django.db.backends.postgresql.psycopg_any import BaseTzLoader, get_adapters_template

        zone = conn.timezone

        class IsoTzLoader(BaseTzLoader):
            timezone = zone  # what Django's cursor checks before registering a loader of its own

            def load(self, data):
                try:
                    return datetime.fromisoformat(bytes(data).decode()).replace(tzinfo=zone)
                except ValueError:
                    return super().load(data)

        get_adapters_template(settings.USE_TZ, zone).register_loader("timestamptz", IsoTzLoader)
