"""The outbox relay: committed event rows → the WebSocket clients of this ASGI process.

One relay runs per process (per event loop). It reads committed ``Event`` rows after its
cursor, in id order, and hands each to the subscribers of this process whose subscriptions
match (run, project, organization, or everything for operators). Delivery is in-process,
never through a Channels layer, so nothing is dropped silently: a subscriber that cannot
keep up is switched to a catch-up read from the database.

Waking: on PostgreSQL a statement trigger on ``core_event`` sends ``NOTIFY orchestrator_events``
(delivered at commit, none for a rolled-back transaction); the relay LISTENs on its own
connection and also polls every second as a safety net. On SQLite it polls every 100 ms.
A database restart ends the LISTEN connection; the relay reconnects with backoff and
resumes from its cursor.

Event ids come from a sequence, so a transaction that commits later may hold a smaller id.
A missing id holds delivery back until the transaction that took it has ended: on PostgreSQL
the relay notes, when it first sees the gap, every transaction then running that may hold it
(one that wrote, or one inside an insert into the event table, which takes its id before its
transaction has a transaction id) by its virtual transaction id, which a transaction holds
until after its commit is visible to new snapshots; it skips the id only once none of them is
still running and a fresh read still lacks it (it was rolled back); a commit that comes late is
never skipped. ``GAP_MAX_WAIT_S`` bounds the wait (a transaction left open that long
is logged and skipped). On SQLite, where one writer at a time takes ids, a gap is a rollback:
``GAP_WAIT_S``. A relay that starts while transactions are in flight starts before the oldest
recent missing id, so a late commit below the newest id is not passed over either.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections

logger = logging.getLogger("orchestrator.relay")

CHANNEL = "orchestrator_events"
BATCH = 500
GAP_WAIT_S = 0.5
GAP_MAX_WAIT_S = 30.0
POLL_S_SQLITE = 0.1
POLL_S_POSTGRES = 1.0
SUBSCRIBER_BUFFER = 5_000


def envelope(row: dict[str, Any]) -> dict[str, Any]:
    """The wire form of an event: ``{"id", "type", "ts", "organization", "project", "run", ...payload}``."""
    body = {"id": row["id"], "type": row["type"], "ts": row["created_at"].isoformat(),
            "organization": row["organization_id"], "project": row["project_id"], "run": row["run_id"]}
    for key, value in (row["payload"] or {}).items():
        body.setdefault(key, value)
    return body


EVENT_FIELDS = ("id", "type", "created_at", "organization_id", "project_id", "run_id", "payload")


def events_after(after: int, *, upto: int | None = None, limit: int = BATCH, run: int | None = None,
                 project: int | None = None, organizations: list[int] | None = None) -> list[dict]:
    """Committed events with ``after < id <= upto`` matching the filters, in id order."""
    from core.models import Event

    queryset = Event.objects.filter(id__gt=after).order_by("id")
    if upto is not None:
        queryset = queryset.filter(id__lte=upto)
    if run is not None:
        queryset = queryset.filter(run_id=run)
    if project is not None:
        queryset = queryset.filter(project_id=project)
    if organizations is not None:
        queryset = queryset.filter(organization_id__in=organizations)
    return list(queryset.values(*EVENT_FIELDS)[:limit])


def _fetch(after: int) -> list[dict]:
    close_old_connections()
    try:
        return events_after(after)
    finally:
        close_old_connections()  # give a pooled connection back between reads


def _running_transactions() -> list[str]:
    """PostgreSQL: the virtual ids of the transactions that may hold an event id not yet visible.

    A transaction holds the lock on its virtual id from its start until after its commit is
    visible to new snapshots, so "none of these is held any more" means a fresh read sees all
    they committed. Counted: this database's client sessions (this one excepted) that have a
    transaction id (they wrote), or that are inside an insert into the event table (it takes its
    id before its transaction has a transaction id). A long read-only transaction, a
    backup's for one, does not hold delivery back."""
    close_old_connections()
    try:
        return _running_on_this_connection()
    finally:
        close_old_connections()


def _running_on_this_connection() -> list[str]:
    from django.db import connection

    from core.models import Event

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT l.virtualxid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'virtualxid' AND l.granted AND l.virtualxid = l.virtualtransaction"
            " AND a.pid <> pg_backend_pid() AND a.datname = current_database()"
            " AND (a.backend_xid IS NOT NULL OR (a.state = 'active' AND a.query ~* %s))",
            [rf'insert\s+into\s+"?{Event._meta.db_table}\M'])
        return [row[0] for row in cursor.fetchall()]


def _fetch_after_gap(after: int, holders: list[str]) -> tuple[list[dict], bool]:
    """Whether every transaction of ``holders`` has ended, then (after that check, so what one
    of them committed is seen) the events after ``after``."""
    from django.db import connection

    close_old_connections()
    try:
        ended = True
        if holders:
            with connection.cursor() as cursor:
                cursor.execute("SELECT NOT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'virtualxid' AND granted"
                               " AND virtualxid = ANY(%s))", [holders])
                ended = bool(cursor.fetchone()[0])
        return events_after(after), ended
    finally:
        close_old_connections()


START_WINDOW = 1_000


def _start_cursor() -> int:
    """Where a new relay starts: the newest event; on PostgreSQL, while other transactions run,
    just before the oldest id missing among the last ``START_WINDOW`` (one of them may still
    commit it: the gap rule then decides). On SQLite one writer at a time takes ids: a missing
    id below the newest was rolled back."""
    from django.conf import settings
    from django.db.models import Max

    from core.models import Event

    close_old_connections()
    try:
        latest = Event.objects.aggregate(m=Max("id"))["m"] or 0
        # Only a transaction that has been running since before that read can hold a missing
        # id below it; read the ids after looking, so one that ended meanwhile is seen.
        if not settings.DATABASE_IS_POSTGRES or not _running_on_this_connection():
            return latest
        recent = list(Event.objects.filter(id__gt=latest - START_WINDOW).order_by("id").values_list("id", flat=True))
        for previous, current in zip(recent, recent[1:]):
            if current != previous + 1:
                return previous
        return latest
    finally:
        close_old_connections()


@dataclass(eq=False)
class Subscriber:
    """One WebSocket connection's interests and its in-order delivery buffer."""

    groups: set[str] = field(default_factory=set)
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(SUBSCRIBER_BUFFER))
    overflowed: bool = False

    def offer(self, event: dict) -> None:
        if self.overflowed:
            return
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.overflowed = True  # the consumer catches up from the database


def groups_of(event: dict) -> list[str]:
    groups = ["all"]
    if event.get("organization") is not None:
        groups.append(f"organization.{event['organization']}")
    if event.get("project") is not None:
        groups.append(f"project.{event['project']}")
    if event.get("run") is not None:
        groups.append(f"run.{event['run']}")
    return groups


class Relay:
    """The per-event-loop relay and its subscriber registry."""

    _by_loop: dict[int, "Relay"] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.cursor: int | None = None
        self.groups: dict[str, set[Subscriber]] = {}
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.started_at = time.time()
        self.delivered = 0
        self.last_delivery_at: float | None = None
        self.connected_listener = False
        self.gap_since: float | None = None
        self.gap_holders: list[str] | None = None
        self.started = asyncio.Event()  # set once the cursor is known

    @classmethod
    async def get(cls) -> "Relay":
        loop = asyncio.get_running_loop()
        relay = cls._by_loop.get(id(loop))
        if relay is None or relay.loop is not loop:
            relay = cls(loop)
            cls._by_loop[id(loop)] = relay
        if relay.task is None or relay.task.done():
            # No await between the check and the start: connections that arrive together share
            # one reader (two would move one cursor back and forth).
            relay.task = loop.create_task(relay._run(), name="orchestrator-relay")
        await relay.started.wait()
        return relay

    # --- subscribers ---------------------------------------------------------------------
    def subscribe(self, subscriber: Subscriber, group: str) -> int:
        """Add ``subscriber`` to ``group``; returns the cursor: later events come live."""
        subscriber.groups.add(group)
        self.groups.setdefault(group, set()).add(subscriber)
        return self.cursor or 0

    def unsubscribe(self, subscriber: Subscriber) -> None:
        for group in subscriber.groups:
            members = self.groups.get(group)
            if members is not None:
                members.discard(subscriber)
                if not members:
                    self.groups.pop(group, None)
        subscriber.groups.clear()

    def dispatch(self, event: dict) -> None:
        seen: set[int] = set()
        for group in groups_of(event):
            for subscriber in self.groups.get(group, ()):
                if id(subscriber) not in seen:
                    seen.add(id(subscriber))
                    subscriber.offer(event)

    # --- the loop ----------------------------------------------------------------------
    async def _start(self) -> None:
        backoff = 0.1
        while self.cursor is None:
            try:
                self.cursor = await sync_to_async(_start_cursor, thread_sensitive=False)()
            except Exception:
                logger.exception("relay could not read where to start; retrying in %.1fs", backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        self.started.set()

    async def _run(self) -> None:
        await self._start()
        listener = None
        if settings.DATABASE_IS_POSTGRES:
            listener = self.loop.create_task(self._listen(), name="orchestrator-relay-listen")
        poll = POLL_S_POSTGRES if settings.DATABASE_IS_POSTGRES else POLL_S_SQLITE
        backoff = 0.1
        try:
            while True:
                try:
                    more = await self._pump()
                    backoff = 0.1
                except Exception:
                    logger.exception("relay could not read events; retrying in %.1fs", backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                if more:
                    continue
                wait = GAP_WAIT_S / 5 if self.gap_since is not None else poll
                # Not ``asyncio.wait_for``: on Python 3.11 it returns the wake-up instead of
                # raising when the task is cancelled in the moment the wake-up comes, and a
                # relay that ignores its cancellation keeps its event loop from ever closing.
                try:
                    async with asyncio.timeout(wait):
                        await self.wake.wait()
                except TimeoutError:
                    pass
                self.wake.clear()
        finally:
            if listener is not None:
                listener.cancel()

    async def _pump(self) -> bool:
        """Deliver the next batch; True when there may be more right away."""
        ended = False
        if self.gap_holders is not None:
            rows, ended = await sync_to_async(_fetch_after_gap, thread_sensitive=False)(
                self.cursor or 0, self.gap_holders)
        else:
            rows = await sync_to_async(_fetch, thread_sensitive=False)(self.cursor or 0)
        expected = (self.cursor or 0) + 1
        for row in rows:
            if row["id"] != expected:
                now = time.monotonic()
                if self.gap_since is None:
                    self.gap_since = now
                if settings.DATABASE_IS_POSTGRES and self.gap_holders is None:
                    self.gap_holders = await sync_to_async(_running_transactions, thread_sensitive=False)()
                    return False  # wait for the transactions that may hold the missing id to end
                waited = now - self.gap_since
                if settings.DATABASE_IS_POSTGRES:
                    if not ended and waited < GAP_MAX_WAIT_S:
                        return False
                    if not ended:
                        logger.warning("relay skipped event ids %s..%s: their transaction is still open after %.0f s",
                                       expected, row["id"] - 1, waited)
                elif waited < GAP_WAIT_S:
                    return False
            self.gap_since = None
            self.gap_holders = None
            event = envelope(row)
            self.cursor = row["id"]
            expected = row["id"] + 1
            self.dispatch(event)
            self.delivered += 1
            self.last_delivery_at = time.time()
        return len(rows) == BATCH

    async def _listen(self) -> None:
        import psycopg

        db = settings.DATABASES["default"]
        params = {"dbname": db["NAME"], "user": db.get("USER") or None, "password": db.get("PASSWORD") or None,
                  "host": db.get("HOST") or None, "port": db.get("PORT") or None}
        params = {key: value for key, value in params.items() if value}
        backoff = 0.2
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(autocommit=True, **params)
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    self.connected_listener = True
                    backoff = 0.2
                    self.wake.set()  # catch up on what was committed while disconnected
                    async for _ in conn.notifies():
                        self.wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.connected_listener = False
                logger.warning("relay LISTEN connection lost (%s); reconnecting in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def status(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "delivered": self.delivered, "subscriptions": sum(map(len, self.groups.values())),
                "listening": self.connected_listener, "last_delivery_at": self.last_delivery_at}


def relay_status() -> dict[str, Any] | None:
    """The status of this process's relays (None when none runs here), for health checks."""
    from core.models import Event

    relays = [relay for relay in Relay._by_loop.values() if relay.task is not None and not relay.task.done()]
    if not relays:
        return None
    latest = Event.objects.order_by("-id").values_list("id", flat=True).first() or 0
    cursor = min(relay.cursor or 0 for relay in relays)
    return {"cursor": cursor, "latest": latest, "lag": max(0, latest - cursor),
            "subscriptions": sum(relay.status()["subscriptions"] for relay in relays)}
