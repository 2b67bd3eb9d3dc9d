"""``/ws/events/`` with Channels' WebsocketCommunicator: auth, tenancy, replay, order, bursts."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction

from core.models import Event
from core.services import event_record
from orchestrator_site.asgi import application
from runs import services
from tests.conftest import make_plan

pytestmark = pytest.mark.django_db(transaction=True)
ORIGIN = (b"origin", b"http://localhost")


def session_cookie(client, user) -> tuple[bytes, bytes]:
    client.force_login(user)
    return b"cookie", f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()


async def connect(headers=()):
    communicator = WebsocketCommunicator(application, "/ws/events/", headers=[ORIGIN, *headers])
    connected, _ = await communicator.connect()
    assert connected
    return communicator


async def receive_events(communicator, count, timeout=10.0):
    events = []
    while len(events) < count:
        message = await communicator.receive_json_from(timeout=timeout)
        if "id" in message and "type" in message and message["type"] not in ("subscribed",):
            events.append(message)
    return events


async def expect_nothing(communicator, wait=0.4):
    assert await communicator.receive_nothing(timeout=wait)


async def subscribed(cookie, **subscription):
    """A connection authenticated by ``cookie`` and subscribed (``organization=3, after=...``)."""
    communicator = await connect([cookie])
    await communicator.receive_json_from(timeout=5)
    await communicator.send_json_to({"action": "subscribe", **subscription})
    assert (await communicator.receive_json_from(timeout=5))["type"] == "subscribed"
    return communicator


# An event written beside Django (other sessions): the id given, or the sequence's next one.
INSERT_EVENT = ("INSERT INTO core_event (id, type, organization_id, project_id, payload, created_at) "
                "VALUES (COALESCE(%s, nextval(pg_get_serial_sequence('core_event', 'id'))), %s, %s, %s, '{}', now()) "
                "RETURNING id")


def database_conninfo() -> str:
    """psycopg connection parameters for this test's PostgreSQL database (other sessions than Django's)."""
    from django.db import connection

    db = connection.settings_dict
    return (f"dbname={db['NAME']} user={db.get('USER') or 'postgres'} host={db.get('HOST') or '127.0.0.1'} "
            f"port={db.get('PORT') or 5432}")


@pytest.fixture
def member(org_factory, client):
    organization, project, owner = org_factory()
    return organization, project, owner, session_cookie(client, owner)


def test_unauthenticated_socket_is_closed_with_4401():
    async def scenario():
        communicator = await connect()
        await communicator.send_json_to({"action": "subscribe", "organization": 1})
        assert (await communicator.receive_output(timeout=5)) == {"type": "websocket.close", "code": 4401}

    asyncio.run(scenario())


def test_a_bad_token_is_closed_with_4401():
    async def scenario():
        communicator = await connect()
        await communicator.send_json_to({"action": "auth", "token": "nope"})
        assert (await communicator.receive_output(timeout=5)) == {"type": "websocket.close", "code": 4401}

    asyncio.run(scenario())


def test_cookie_session_subscribes_and_replays_a_run_in_order(member):
    organization, project, owner, cookie = member
    run = services.run_create(project=project, name="watched", plan=make_plan())
    services.run_start(run_id=run.pk)
    expected = list(Event.objects.filter(run_id=run.pk).order_by("id").values_list("id", "type"))

    async def scenario():
        communicator = await connect([cookie])
        hello = await communicator.receive_json_from(timeout=5)
        assert hello["type"] == "hello" and hello["user"] == owner.username
        await communicator.send_json_to({"action": "subscribe", "run": run.pk, "after": 0})
        subscribed = await communicator.receive_json_from(timeout=5)
        assert subscribed["type"] == "subscribed"
        replayed = await receive_events(communicator, len(expected))
        assert [(e["id"], e["type"]) for e in replayed] == expected
        assert all(e["run"] == run.pk and e["organization"] == organization.pk for e in replayed)
        await sync_to_async(services.run_cancel)(run_id=run.pk, reason="live")
        live = await receive_events(communicator, 2)  # ledger refund + run_cancelled
        assert [e["type"] for e in live] == ["ledger_refund", "run_cancelled"]
        assert live[0]["id"] > replayed[-1]["id"]
        await communicator.disconnect()

    asyncio.run(scenario())


def test_subscriptions_are_limited_to_the_users_organizations(member, org_factory):
    _, _, _, cookie = member
    other_org, other_project, _ = org_factory()
    foreign_run = services.run_create(project=other_project, name="foreign", plan=make_plan())

    async def scenario():
        communicator = await connect([cookie])
        await communicator.receive_json_from(timeout=5)
        for scope, object_id in (("run", foreign_run.pk), ("project", other_project.pk),
                                 ("organization", other_org.pk), ("all", True), ("run", 999_999)):
            await communicator.send_json_to({"action": "subscribe", scope: object_id, "after": 0})
            refused = await communicator.receive_json_from(timeout=5)
            assert refused["type"] == "error" and refused["code"] == "forbidden"
        await sync_to_async(services.run_start)(run_id=foreign_run.pk)
        await expect_nothing(communicator)
        await communicator.disconnect()

    asyncio.run(scenario())


def test_staff_with_the_view_permission_may_watch_everything(org_factory, client):
    from django.contrib.auth.models import Permission

    _, project, _ = org_factory()
    staff = get_user_model().objects.create_user(username="watcher", is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_event", content_type__app_label="core"))
    cookie = session_cookie(client, staff)

    async def scenario():
        communicator = await connect([cookie])
        await communicator.receive_json_from(timeout=5)
        await communicator.send_json_to({"action": "subscribe", "all": True})
        assert (await communicator.receive_json_from(timeout=5))["type"] == "subscribed"
        await sync_to_async(services.run_create)(project=project, name="any", plan=make_plan())
        event = (await receive_events(communicator, 1))[0]
        assert event["type"] == "run_created"
        await communicator.disconnect()

    asyncio.run(scenario())


def test_overlapping_subscriptions_never_send_an_event_twice(member):
    organization, project, _, cookie = member

    async def scenario():
        communicator = await connect([cookie])
        await communicator.receive_json_from(timeout=5)
        for message in ({"action": "subscribe", "organization": organization.pk},
                        {"action": "subscribe", "project": project.pk}):
            await communicator.send_json_to(message)
            await communicator.receive_json_from(timeout=5)
        run = await sync_to_async(services.run_create)(project=project, name="twice?", plan=make_plan())
        await sync_to_async(services.run_start)(run_id=run.pk)
        events = await receive_events(communicator, 4)
        assert [e["type"] for e in events] == ["run_created", "ledger_reserve", "run_pending",
                                               "orchestrator_job_queued"]
        assert events[-1]["jobType"] == "run_step" and events[-1]["projectId"] == project.pk  # its start
        await expect_nothing(communicator)
        await communicator.disconnect()

    asyncio.run(scenario())


def test_a_rolled_back_service_call_emits_nothing(member):
    organization, project, _, cookie = member

    async def scenario():
        communicator = await connect([cookie])
        await communicator.receive_json_from(timeout=5)
        await communicator.send_json_to({"action": "subscribe", "organization": organization.pk})
        await communicator.receive_json_from(timeout=5)

        def doomed():
            with transaction.atomic():
                services.run_create(project=project, name="rolled back", plan=make_plan())
                raise RuntimeError("abort")

        with pytest.raises(RuntimeError):
            await sync_to_async(doomed)()
        await expect_nothing(communicator, wait=1.0)
        await communicator.disconnect()

    asyncio.run(scenario())
    assert not Event.objects.filter(type="run_created").exists()


def test_a_burst_of_1000_events_reaches_100_clients_complete_and_in_order(member):
    organization, project, _, cookie = member

    def burst():
        for index in range(1000):
            event_record(type="drill_burst", organization_id=organization.pk, project_id=project.pk,
                         payload={"n": index})

    async def scenario():
        clients = [await connect([cookie]) for _ in range(100)]
        for communicator in clients:
            await communicator.receive_json_from(timeout=5)
            await communicator.send_json_to({"action": "subscribe", "organization": organization.pk})
            await communicator.receive_json_from(timeout=5)
        await sync_to_async(burst)()
        for communicator in clients:
            events = await receive_events(communicator, 1000, timeout=20)
            assert [e["n"] for e in events] == list(range(1000))
            ids = [e["id"] for e in events]
            assert ids == sorted(ids) and len(set(ids)) == 1000
        for communicator in clients:
            await communicator.disconnect()

    asyncio.run(scenario())


def test_an_api_token_in_the_first_message_authenticates(org_factory):
    from rest_framework.authtoken.models import Token

    organization, project, owner = org_factory()
    token = Token.objects.create(user=owner)

    async def scenario():
        communicator = await connect()
        await communicator.send_json_to({"action": "auth", "token": token.key})
        hello = await communicator.receive_json_from(timeout=5)
        assert hello["type"] == "hello" and hello["user"] == owner.username
        await communicator.send_json_to({"action": "subscribe", "project": project.pk})
        assert (await communicator.receive_json_from(timeout=5))["type"] == "subscribed"
        await sync_to_async(services.run_create)(project=project, name="by token", plan=make_plan())
        assert (await receive_events(communicator, 1))[0]["type"] == "run_created"
        await communicator.disconnect()

    asyncio.run(scenario())


@pytest.mark.postgres
def test_an_event_committed_late_behind_a_later_one_is_delivered_and_a_rolled_back_id_is_skipped(member):
    """Ids come from a sequence: a transaction may commit its event well after a later id is
    visible. The relay waits for that transaction to end (not a fixed delay), delivers the late
    event in order, and skips an id whose transaction rolled back."""
    import psycopg

    organization, project, _, cookie = member
    conninfo = database_conninfo()

    async def scenario():
        communicator = await subscribed(cookie, organization=organization.pk)
        with psycopg.connect(conninfo) as slow, psycopg.connect(conninfo) as doomed, \
                psycopg.connect(conninfo, autocommit=True) as fast:
            late = slow.execute(INSERT_EVENT, [None, "late_commit", organization.pk, project.pk]).fetchone()[0]
            lost = doomed.execute(INSERT_EVENT, [None, "rolled_back", organization.pk, project.pk]).fetchone()[0]
            early = fast.execute(INSERT_EVENT, [None, "early_commit", organization.pk, project.pk]).fetchone()[0]
            assert late < lost < early
            await asyncio.sleep(2.0)  # far longer than a fixed gap delay would wait
            await expect_nothing(communicator, wait=0.3)  # held back: the late one is still open
            slow.commit()
            doomed.rollback()
            events = await receive_events(communicator, 2, timeout=10)
        assert [(event["id"], event["type"]) for event in events] == [(late, "late_commit"), (early, "early_commit")]
        await expect_nothing(communicator)
        await communicator.disconnect()

    asyncio.run(scenario())


@pytest.mark.postgres
def test_a_late_event_whose_transaction_is_newer_than_the_gaps_snapshot_is_not_skipped(member):
    """A snapshot does not list running transactions above its ``xmax``: a transaction that took
    its event id early but its transaction id after the later event's must still be waited for."""
    import psycopg

    organization, project, _, cookie = member
    conninfo = database_conninfo()

    async def scenario():
        communicator = await subscribed(cookie, organization=organization.pk)
        with psycopg.connect(conninfo) as late_tx, psycopg.connect(conninfo) as early_tx:
            reserved = late_tx.execute("SELECT nextval(pg_get_serial_sequence('core_event', 'id'))").fetchone()[0]
            early = early_tx.execute(INSERT_EVENT, [None, "early_commit", organization.pk, project.pk]).fetchone()[0]
            late_tx.execute(INSERT_EVENT, [reserved, "late_commit", organization.pk, project.pk])  # a newer xid
            early_tx.commit()
            await asyncio.sleep(2.0)
            await expect_nothing(communicator, wait=0.3)
            late_tx.commit()
            events = await receive_events(communicator, 2, timeout=10)
        assert [(event["id"], event["type"]) for event in events] == [(reserved, "late_commit"),
                                                                      (early, "early_commit")]
        await communicator.disconnect()

    asyncio.run(scenario())


@pytest.mark.postgres
def test_an_insert_that_took_its_id_but_has_no_transaction_id_yet_is_waited_for(member):
    """An insert takes its event id before its transaction has a transaction id (that comes with
    the row's write): a relay that sees the gap in between still waits for that transaction. A
    row trigger that sleeps holds an insert there."""
    import psycopg

    organization, project, _, cookie = member
    conninfo = database_conninfo()
    with psycopg.connect(conninfo, autocommit=True) as admin:
        admin.execute("CREATE FUNCTION test_hold_late_event() RETURNS trigger AS $$ BEGIN"
                      " IF NEW.type = 'late_commit' THEN PERFORM pg_sleep(1.5); END IF; RETURN NEW; END"
                      " $$ LANGUAGE plpgsql")
        admin.execute("CREATE TRIGGER test_hold_late_event BEFORE INSERT ON core_event"
                      " FOR EACH ROW EXECUTE FUNCTION test_hold_late_event()")

    def insert_late(connection) -> tuple[int, object]:
        late = connection.execute(INSERT_EVENT, [None, "late_commit", organization.pk, project.pk]).fetchone()[0]
        return late, connection.execute("SELECT pg_current_xact_id_if_assigned()").fetchone()[0]

    async def scenario():
        communicator = await subscribed(cookie, organization=organization.pk)
        with psycopg.connect(conninfo) as late_tx, psycopg.connect(conninfo, autocommit=True) as fast:
            inserting = asyncio.get_running_loop().run_in_executor(None, insert_late, late_tx)
            await asyncio.sleep(0.5)  # the late insert has its id and sleeps before writing its row
            early = fast.execute(INSERT_EVENT, [None, "early_commit", organization.pk, project.pk]).fetchone()[0]
            await asyncio.sleep(0.5)  # the relay has seen the gap
            late, xid = await inserting
            assert late < early and xid is not None
            await asyncio.sleep(0.5)
            await expect_nothing(communicator, wait=0.3)
            late_tx.commit()
            events = await receive_events(communicator, 2, timeout=10)
        assert [(event["id"], event["type"]) for event in events] == [(late, "late_commit"), (early, "early_commit")]
        await communicator.disconnect()

    try:
        asyncio.run(scenario())
    finally:
        with psycopg.connect(conninfo, autocommit=True) as admin:
            admin.execute("DROP TRIGGER IF EXISTS test_hold_late_event ON core_event")
            admin.execute("DROP FUNCTION IF EXISTS test_hold_late_event()")


@pytest.mark.postgres
def test_a_long_read_only_transaction_does_not_hold_delivery_back(member):
    """A backup or a report reading in a long transaction cannot hold an event id: a gap left by
    a rolled-back insert is passed as soon as the writers have ended, not after the reader."""
    import psycopg

    organization, project, _, cookie = member
    conninfo = database_conninfo()

    async def scenario():
        communicator = await subscribed(cookie, organization=organization.pk)
        with psycopg.connect(conninfo) as reader, psycopg.connect(conninfo) as doomed, \
                psycopg.connect(conninfo, autocommit=True) as fast:
            reader.execute("SELECT count(*) FROM core_event").fetchone()  # a transaction left open
            doomed.execute(INSERT_EVENT, [None, "rolled_back", organization.pk, project.pk])
            early = fast.execute(INSERT_EVENT, [None, "early_commit", organization.pk, project.pk]).fetchone()[0]
            await asyncio.sleep(0.5)
            doomed.rollback()
            events = await receive_events(communicator, 1, timeout=5)
            assert [(event["id"], event["type"]) for event in events] == [(early, "early_commit")]
            reader.rollback()
        await communicator.disconnect()

    asyncio.run(scenario())


@pytest.mark.postgres
def test_a_relay_that_starts_while_an_event_is_uncommitted_below_the_newest_still_delivers_it(member):
    """A process that starts its relay while a transaction holds an id below the newest event
    does not start past it: the event is delivered when it commits, before the newer one."""
    import psycopg

    organization, project, _, cookie = member
    conninfo = database_conninfo()

    async def scenario(late_tx, after):
        # This event loop's relay starts with this connection.
        communicator = await subscribed(cookie, organization=organization.pk, after=after)
        await asyncio.sleep(0.5)
        late_tx.commit()
        events = await receive_events(communicator, 2, timeout=10)
        await communicator.disconnect()
        return [(event["id"], event["type"]) for event in events]

    with psycopg.connect(conninfo) as late_tx, psycopg.connect(conninfo, autocommit=True) as fast:
        late = late_tx.execute(INSERT_EVENT, [None, "late_commit", organization.pk, project.pk]).fetchone()[0]
        early = fast.execute(INSERT_EVENT, [None, "early_commit", organization.pk, project.pk]).fetchone()[0]
        assert asyncio.run(scenario(late_tx, late - 1)) == [(late, "late_commit"), (early, "early_commit")]


def test_connections_that_arrive_together_share_one_relay_reader(member):
    """Every connection of a process shares one reader of the event table, however many arrive
    while it is still finding where to start; each of them then gets every event once."""
    organization, project, _, cookie = member

    async def scenario():
        clients = await asyncio.gather(*(connect([cookie]) for _ in range(20)))
        for communicator in clients:
            await communicator.receive_json_from(timeout=5)
        readers = [task for task in asyncio.all_tasks() if task.get_name() == "orchestrator-relay"]
        assert len(readers) == 1
        for communicator in clients:
            await communicator.send_json_to({"action": "subscribe", "project": project.pk})
            await communicator.receive_json_from(timeout=5)
        ids = await sync_to_async(lambda: [event_record(type="step_once", organization_id=organization.pk,
                                                        project_id=project.pk).pk for _ in range(5)])()
        for communicator in clients:
            assert [event["id"] for event in await receive_events(communicator, 5)] == ids
            await expect_nothing(communicator, wait=0.05)
            await communicator.disconnect()

    asyncio.run(scenario())


def test_a_live_event_arriving_as_a_subscription_registers_waits_for_its_replay(member, monkeypatch):
    """The stream stays in id order: an event that goes live while the subscription's replay is
    still to be sent is held until the replay is done, and the replayed events are not lost."""
    from core.relay import EVENT_FIELDS, Relay, envelope

    organization, project, _, cookie = member
    first, second, third = [event_record(type=f"step_{n}", organization_id=organization.pk,
                                         project_id=project.pk).pk for n in range(3)]
    third_live = envelope(Event.objects.filter(pk=third).values(*EVENT_FIELDS).get())
    registered = Relay.subscribe

    def subscribe_as_an_event_goes_live(self, subscriber, group):
        registered(self, subscriber, group)
        subscriber.offer(third_live)  # the relay hands over the next event at once
        return second  # ... while the subscription's replay reaches only the one before

    monkeypatch.setattr(Relay, "subscribe", subscribe_as_an_event_goes_live)

    async def scenario():
        communicator = await connect([cookie])
        await communicator.receive_json_from(timeout=5)
        await communicator.send_json_to({"action": "subscribe", "project": project.pk, "after": first - 1})
        assert (await communicator.receive_json_from(timeout=5))["type"] == "subscribed"
        events = await receive_events(communicator, 3)
        assert [event["id"] for event in events] == [first, second, third]
        await expect_nothing(communicator)
        await communicator.disconnect()

    asyncio.run(scenario())


def test_a_subscription_after_an_id_this_relay_has_not_reached_gets_no_duplicates(member, monkeypatch):
    """A client that comes from a process whose relay was further on subscribes with an ``after``
    ahead of this relay's cursor: the events up to there, which it has, are not sent again."""
    from core.relay import EVENT_FIELDS, Relay, envelope

    organization, project, _, cookie = member
    ids = [event_record(type=f"step_{n}", organization_id=organization.pk, project_id=project.pk).pk
           for n in range(4)]
    envelopes = [envelope(row) for row in Event.objects.filter(pk__in=ids).order_by("id").values(*EVENT_FIELDS)]
    registered = Relay.subscribe

    def subscribe_behind(self, subscriber, group):
        registered(self, subscriber, group)
        for event in envelopes[1:]:  # this relay still has to hand over all but the first
            subscriber.offer(event)
        return ids[0]

    monkeypatch.setattr(Relay, "subscribe", subscribe_behind)

    async def scenario():
        communicator = await connect([cookie])
        await communicator.receive_json_from(timeout=5)
        await communicator.send_json_to({"action": "subscribe", "project": project.pk, "after": ids[2]})
        assert (await communicator.receive_json_from(timeout=5))["type"] == "subscribed"
        events = await receive_events(communicator, 1)
        assert [event["id"] for event in events] == [ids[3]]
        await expect_nothing(communicator)
        await communicator.disconnect()

    asyncio.run(scenario())


def test_a_client_that_overflows_its_buffer_catches_up_from_the_database_in_order(member, monkeypatch):
    monkeypatch.setattr("core.relay.SUBSCRIBER_BUFFER", 5)
    organization, project, _, cookie = member

    def burst():
        with transaction.atomic():
            return [event_record(type="step_burst", organization_id=organization.pk, project_id=project.pk).pk
                    for _ in range(40)]

    async def scenario():
        communicator = await connect([cookie])
        await communicator.receive_json_from(timeout=5)
        await communicator.send_json_to({"action": "subscribe", "project": project.pk})
        await communicator.receive_json_from(timeout=5)
        ids = await sync_to_async(burst)()
        events = await receive_events(communicator, len(ids))
        assert [event["id"] for event in events] == ids
        await expect_nothing(communicator)
        await communicator.disconnect()

    asyncio.run(scenario())


def test_a_staff_actor_reaches_tenants_as_operator_live_and_in_the_replay(member):
    """Tenants see ``operator`` where the console's staff acted; staff watching see the name."""
    from django.contrib.auth.models import Permission
    from django.test import Client

    organization, project, owner, cookie = member
    staff = get_user_model().objects.create_user(username="night-shift-bob", is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_event", content_type__app_label="core"))
    staff_cookie = session_cookie(Client(), staff)
    first = services.run_create(project=project, name="replayed", plan=make_plan(), actor=owner)
    services.run_cancel(run_id=first.pk, actor=staff, reason="stuck")
    second = services.run_create(project=project, name="live", plan=make_plan(), actor=owner)

    async def scenario():
        tenant = await subscribed(cookie, organization=organization.pk, after=0)
        watcher = await subscribed(staff_cookie, organization=organization.pk, after=0)
        await sync_to_async(services.run_cancel)(run_id=second.pk, actor=staff, reason="stuck too")
        count = await sync_to_async(Event.objects.filter(organization_id=organization.pk).count)()
        seen, watched = await receive_events(tenant, count), await receive_events(watcher, count)
        actors = {(e["run"], e["type"]): e.get("actor") for e in seen}
        assert actors[(first.pk, "run_created")] == owner.username  # a member keeps the name
        assert actors[(first.pk, "run_cancelled")] == actors[(second.pk, "run_cancelled")] == "operator"
        assert "night-shift-bob" not in str(seen)
        staff_actors = {(e["run"], e["type"]): e.get("actor") for e in watched}
        assert staff_actors[(second.pk, "run_cancelled")] == "night-shift-bob"
        await tenant.disconnect()
        await watcher.disconnect()

    asyncio.run(scenario())


def test_a_relay_woken_as_its_event_loop_ends_stops(member, monkeypatch):
    """An event loop that ends (a test's, a server's shutdown) cancels its relay: the relay
    stops even when it is woken in the same moment (its listener connected, a NOTIFY came),
    rather than taking the wake-up for its answer and polling on with nobody left to stop it."""
    from core import relay as relay_module

    fetched = []
    fetch = relay_module._fetch
    monkeypatch.setattr(relay_module, "_fetch", lambda after: fetched.append(after) or fetch(after))

    async def scenario():
        relay = await relay_module.Relay.get()
        for _ in range(3):
            count = len(fetched)
            while len(fetched) == count:  # a read has ended: the relay goes back to waiting
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.02)
            assert not relay.task.done()
        relay.wake.set()
        relay.task.cancel()
        done, _ = await asyncio.wait({relay.task}, timeout=3)
        assert done and relay.task.cancelled()

    asyncio.run(scenario())
