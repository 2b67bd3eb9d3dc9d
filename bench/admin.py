"""Benchmark: the console's run pages with 100,000 runs and 1,000,000 ledger entries.

    .venv/bin/python bench/admin.py [--runs 100000] [--ledger 1000000] [--repeat 7] [--db PATH] [--fresh]

Renders, in process through Django's test client as a logged-in superuser, and prints the median
render time of ``--repeat`` renders (after one warm-up) and the query count of: the run
changelist (plain, filtered by status, by the "stuck" filter, by an error code, a name search
and a deep page), the run change page (a run with its ledger entries, and a run with an agent →
task → step tree, events and an escalation), the ledger changelist, the operations dashboard and
its JSON snapshot — each next to Django's empty changelist (the deployments list, which has no
rows) rendered in the same run, as ratios. It also checks that the run changelist's query count
does not depend on the number of rows shown (a page of 100 runs against a project of 10).

The database is a dedicated bench database, never the configured one: a SQLite file
(``var/bench_admin.sqlite3`` by default, ``--db`` to choose another), or, when ``DATABASE_URL``
names a PostgreSQL server, the database ``<that URL's database>_bench_admin`` on that server
(``orchestrator_bench_admin`` when the URL names none), so that two checkouts sharing a server
do not seed each other's bench database. It is seeded
once and reused while it holds at least the requested rows (``--fresh`` rebuilds it; use smaller
``--runs``/``--ledger`` for a quick check).

Seeding is fast because it bypasses the services: runs, attempts, jobs, events and ledger
entries are bulk-inserted with plausible values. In particular the ledger's append-only rules are
not exercised (rows are only inserted, never through ``ledger_*`` services) and its hash chain is
not computed (entries carry a placeholder hash), so ``check_invariants`` reports this database's
ledger as broken. That is acceptable in this bench database only. A handful of runs (and their
ledger entries, events and tree) are made through the services so that the change pages show
real data.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Running ``bench/admin.py`` puts ``bench/`` first on sys.path, where ``bench/queue.py`` would
# shadow the standard library's ``queue``: take the directory off, put the project on.
BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH_DIR]
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from urllib.parse import urlsplit, urlunsplit  # noqa: E402

BENCH_DATABASE = "orchestrator_bench_admin"
DEFAULT_SQLITE = ROOT / "var" / "bench_admin.sqlite3"
ORGANIZATIONS = 10
SMALL_PROJECT_RUNS = 10
ERROR_CODES = ["timeout", "heartbeat_timeout", "tool_failed", "gate_failed:publish", "force_failed",
               "insufficient_credits", "fatal_error", "worker_lost"]
# (status, share of runs)
STATUS_MIX = [("completed", 0.70), ("failed", 0.15), ("cancelled", 0.05), ("running", 0.04), ("pending", 0.03),
              ("paused", 0.02), ("created", 0.01)]
BATCH = 5_000


# --- the bench database -------------------------------------------------------------------------

def bench_database_name(url: str) -> str:
    """The bench database beside the one ``url`` names: ``<name>_bench_admin``."""
    name = urlsplit(url).path.lstrip("/")
    if not name or name == "postgres" or name.endswith("_bench_admin"):
        return BENCH_DATABASE
    return f"{name}_bench_admin"


def _postgres_urls(url: str, database: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return (urlunsplit(parts._replace(path=f"/{database}")),
            urlunsplit(parts._replace(path="/postgres", query="")))


def prepare_environment(args) -> tuple[str, callable]:
    """Point the settings at the bench database; return its label and a function that empties it."""
    url = os.environ.get("DATABASE_URL", "").strip()
    if url.startswith(("postgres://", "postgresql://", "pgsql://")):
        database = bench_database_name(url)
        if urlsplit(url).path.lstrip("/") == database:
            raise SystemExit(f"DATABASE_URL names {database}, the benchmark's own database: give the "
                             "server's usual database instead")
        bench_url, maintenance_url = _postgres_urls(url, database)
        os.environ["DATABASE_URL"] = bench_url

        def recreate() -> None:
            import psycopg
            from django.db import connections

            connections.close_all()
            with psycopg.connect(maintenance_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
                conn.execute(f'CREATE DATABASE "{database}"')

        import psycopg

        with psycopg.connect(maintenance_url, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [database]).fetchone()
        if not exists:
            recreate()
        return f"PostgreSQL (database {database})", recreate
    os.environ.pop("DATABASE_URL", None)
    path = Path(args.db).resolve()
    if path == Path(os.environ.get("ORCHESTRATOR_SQLITE_PATH", ROOT / "var" / "db.sqlite3")).resolve() \
            or path == (ROOT / "var" / "db.sqlite3").resolve():
        raise SystemExit(f"--db {path} is the console's own database: choose another file")
    path.parent.mkdir(parents=True, exist_ok=True)
    os.environ["ORCHESTRATOR_SQLITE_PATH"] = str(path)

    def recreate() -> None:
        from django.db import connections

        connections.close_all()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)

    return f"SQLite (file {path})", recreate


class RowWriter:
    """Inserts plain rows into a model's table with ``executemany`` (no model instances, no
    signals, no ``save()``): about a hundred times faster than ``bulk_create`` on SQLite. Columns a
    row does not give take the field's default (``auto_now`` fields: now)."""

    def __init__(self, model, given: list[str], now):
        from django.db import connection, models

        self.connection = connection
        fields = [field for field in model._meta.concrete_fields
                  if not (field.primary_key and field.attname not in given)]
        self.given = given
        self.converters = []
        for name in given:
            field = model._meta.get_field(name)
            if isinstance(field, models.DateTimeField):
                self.converters.append(connection.ops.adapt_datetimefield_value)
            elif isinstance(field, models.JSONField):
                self.converters.append(lambda value, field=field: field.get_db_prep_save(value, connection))
            else:
                self.converters.append(None)
        self.fixed = []
        for field in fields:
            if field.attname in given:
                continue
            if getattr(field, "auto_now", False) or getattr(field, "auto_now_add", False):
                value = now
            else:
                value = field.get_default()
            self.fixed.append((field.column, field.get_db_prep_save(value, connection)))
        columns = [model._meta.get_field(name).column for name in given] + [column for column, _ in self.fixed]
        quote = connection.ops.quote_name
        self.sql = (f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(quote(c) for c in columns)}) "
                    f"VALUES ({', '.join(['%s'] * len(columns))})")
        self.tail = tuple(value for _, value in self.fixed)

    def write(self, rows) -> int:
        converters = list(enumerate(self.converters))
        prepared = []
        for row in rows:
            values = list(row)
            for index, convert in converters:
                if convert is not None and values[index] is not None:
                    values[index] = convert(values[index])
            prepared.append(tuple(values) + self.tail)
        with self.connection.cursor() as cursor:
            cursor.executemany(self.sql, prepared)
        return len(prepared)


def series_insert(model, given: dict[str, str], source: str, params: list, now, source_params=()) -> int:
    """``INSERT INTO <model's table> (...) SELECT <given SQL expressions>, <defaults> FROM <source>``
    (PostgreSQL: rows made by the server, e.g. from ``generate_series``); the columns ``given`` does
    not name take their field's default, as in ``RowWriter``. ``%s`` in the expressions are
    ``params``, in ``source`` ``source_params``; a
    modulo is written `` % `` (spaced) and escaped here."""
    from django.db import connection

    writer = RowWriter(model, list(given), now)
    quote = connection.ops.quote_name
    columns = [model._meta.get_field(name).column for name in given] + [column for column, _ in writer.fixed]
    sql = (f"INSERT INTO {quote(model._meta.db_table)} ({', '.join(quote(c) for c in columns)}) "
           f"SELECT {', '.join(given.values())}{', ' if writer.fixed else ''}"
           f"{', '.join(['%s'] * len(writer.fixed))} FROM {source}").replace(" % ", " %% ")
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, *writer.tail, *source_params])
        return cursor.rowcount


def seed_bulk_postgres(*, runs: int, ledger: int, next_id: int, small_project: int, projects: list[int],
                       project_org: dict[int, int], first_org: int, first_project: int, now, out) -> None:
    """The runs, attempts, events, ledger entries and jobs of ``seed``, made by the server from
    ``generate_series`` (a million runs in about a minute on two cores)."""
    from django.db import transaction

    from billing.models import LedgerEntry
    from core.models import Event
    from jobs.models import Job
    from runs.models import Run, RunAttempt

    started = time.perf_counter()
    thresholds, total = [], 0.0
    for status, share in STATUS_MIX:
        total += share
        thresholds.append((status, round(total * 1000)))
    status_case = "CASE " + " ".join(f"WHEN (g * 7919) % 1000 < {bound} THEN '{status}'"
                                     for status, bound in thresholds[:-1]) + f" ELSE '{thresholds[-1][0]}' END"
    project_array = "ARRAY[" + ",".join(str(pk) for pk in projects) + "]::bigint[]"
    org_array = "ARRAY[" + ",".join(str(project_org[pk]) for pk in projects) + "]::bigint[]"
    codes = "ARRAY[" + ",".join(f"'{code}'" for code in ERROR_CODES) + "]"
    base = f"""(SELECT g, CASE WHEN g < {SMALL_PROJECT_RUNS} THEN 'completed' ELSE {status_case} END AS status,
                CASE WHEN g < {SMALL_PROJECT_RUNS} THEN {small_project}::bigint
                     ELSE ({project_array})[1 + g % {len(projects)}] END AS project_id,
                CASE WHEN g < {SMALL_PROJECT_RUNS} THEN {project_org[small_project]}::bigint
                     ELSE ({org_array})[1 + g % {len(projects)}] END AS organization_id,
                %s::timestamptz - make_interval(secs => (g::bigint * 104729) % (30 * 86400)) AS created,
                1 + (g * 31) % 3600 AS lasted, (g * 131) % 100 AS charged
         FROM generate_series(0::bigint, %s - 1) AS g) AS s"""
    settled = "s.status IN ('completed', 'failed', 'cancelled')"
    live_charge = "CASE WHEN s.status IN ('created', 'pending') THEN 0 ELSE s.charged END"
    reserved = "CASE WHEN s.status = 'created' THEN 0 ELSE 100 END"
    changed = "LEAST(%s::timestamptz, s.created + make_interval(secs => s.lasted))"
    code = f"CASE WHEN s.status IN ('failed', 'cancelled') THEN ({codes})[1 + s.g % {len(ERROR_CODES)}] ELSE '' END"
    with transaction.atomic():
        made = series_insert(Run, {
            "id": f"{next_id} + s.g", "organization_id": "s.organization_id", "project_id": "s.project_id",
            "name": "'bench run ' || s.g", "plan": "'{\"agents\": []}'::jsonb", "status": "s.status",
            "credit_limit": "100", "credits_reserved": reserved, "credits_charged": live_charge,
            "credits_refunded": f"CASE WHEN {settled} THEN {reserved} - {live_charge} ELSE 0 END",
            "last_error_code": code, "last_error": f"CASE WHEN {code} = '' THEN '' ELSE {code} || ': bench' END",
            "created_at": "s.created", "status_changed_at": changed,
            "started_at": "CASE WHEN s.status IN ('created', 'pending') THEN NULL ELSE s.created END",
            "completed_at": f"CASE WHEN s.status = 'completed' THEN {changed} END",
            "cancelled_at": f"CASE WHEN s.status = 'cancelled' THEN {changed} END",
            "last_heartbeat": "CASE WHEN s.status = 'running' "
                              "THEN %s::timestamptz - make_interval(secs => s.g % 120) END",
        }, base, [now] * 4, now, source_params=[now, runs])
    print(f"  runs: {made:,} ({time.perf_counter() - started:.1f} s)", file=out, flush=True)
    mine = f"{Run._meta.db_table} AS r WHERE r.id >= {int(next_id)}"
    with transaction.atomic():
        series_insert(RunAttempt, {
            "run_id": "r.id", "number": "1", "credits_reserved": "r.credits_reserved",
            "credits_charged": "r.credits_charged", "credits_refunded": "r.credits_refunded",
            "outcome": "CASE WHEN r.status IN ('completed', 'failed', 'cancelled') THEN r.status ELSE '' END",
            "error_code": "r.last_error_code", "created_at": "r.created_at",
            "ended_at": "CASE WHEN r.status IN ('completed', 'failed', 'cancelled') THEN r.status_changed_at END",
        }, f"{mine} AND r.status <> 'created'", [], now)
        series_insert(Event, {
            "type": "'run_' || r.status", "organization_id": "r.organization_id", "project_id": "r.project_id",
            "run_id": "r.id", "payload": "jsonb_build_object('to', r.status)", "created_at": "r.status_changed_at",
        }, mine, [], now)
    print(f"  attempts and events ({time.perf_counter() - started:.1f} s)", file=out, flush=True)
    missing = max(0, ledger - LedgerEntry.objects.count())
    live = Run.objects.filter(pk__gte=next_id).exclude(status="created").count()
    per_run = max(1, -(-missing // max(1, live)))
    if missing:
        with transaction.atomic():
            written = series_insert(LedgerEntry, {
                "organization_id": "r.organization_id", "run_id": "r.id", "attempt_number": "1",
                "kind": f"CASE WHEN n = 0 THEN 'reserve' WHEN n = {per_run - 1} AND r.status IN "
                        "('completed', 'failed', 'cancelled') THEN 'refund' ELSE 'charge' END",
                "source": f"CASE WHEN n > 0 AND n = {per_run - 1} AND r.status IN "
                          "('completed', 'failed', 'cancelled') THEN 'reservation' ELSE '' END",
                "amount": "CASE WHEN n = 0 THEN 100 ELSE 1 END", "idempotency_key": "'bench:' || n",
                "actor_label": "'system'", "reason": "'bench'", "balance_after": str(10**12),
                "reserved_after": "100", "prev_hash": "''", "entry_hash": "'bench-unchained'",
                "created_at": "r.created_at + make_interval(secs => n)",
            }, f"(SELECT * FROM {mine} AND r.status <> 'created') AS r CROSS JOIN generate_series(0, {per_run - 1}) AS n "
               f"LIMIT {int(missing)}", [], now)
        print(f"  ledger entries: {written:,} ({time.perf_counter() - started:.1f} s)", file=out, flush=True)
    with transaction.atomic():
        series_insert(Job, {
            "type": "'run_step'", "organization_id": str(first_org), "project_id": str(first_project),
            "run_id": f"{next_id} + g % {runs}", "state": "CASE WHEN g % 50 = 0 THEN 'failed' ELSE 'completed' END",
            "reason": "CASE WHEN g % 50 = 0 THEN 'fatal_error' ELSE 'completed' END",
            "lane": f"'run:' || ({next_id} + g % {runs})", "payload": "'{}'::jsonb", "attempts": "1",
            "created_at": "%s::timestamptz - make_interval(secs => (g * 7919) % 86400)",
            "queued_at": "%s::timestamptz - make_interval(secs => (g * 7919) % 86400)",
            "started_at": "%s::timestamptz - make_interval(secs => (g * 7919) % 86400)",
            "completed_at": "%s::timestamptz - make_interval(secs => (g * 7919) % 86400)",
        }, "generate_series(0, 19999) AS g", [now, now, now, now], now)
        series_insert(Job, {
            "type": "'noop'", "organization_id": str(first_org), "project_id": str(first_project), "state": "'queued'",
            "reason": "''", "lane": "'project:' || (g % 7)", "payload": "'{}'::jsonb", "attempts": "0",
            "created_at": "%s::timestamptz", "queued_at": "%s::timestamptz",
        }, "generate_series(0, 49) AS g", [now, now], now)
    print(f"  jobs ({time.perf_counter() - started:.1f} s)", file=out, flush=True)


def seeded(runs: int, ledger: int) -> bool:
    from django.db.utils import DatabaseError

    from billing.models import LedgerEntry
    from runs.models import Run

    try:
        return Run.objects.count() >= runs and LedgerEntry.objects.count() >= ledger
    except DatabaseError:
        return False


def seed(*, runs: int, ledger: int, out) -> dict:
    """Fill the bench database: services for the tenancy and a few showcase runs, bulk inserts for the rest."""
    from django.core.management.color import no_style
    from django.db import connection, transaction
    from django.utils import timezone

    from billing.models import CreditAccount, LedgerEntry
    from billing.services import organization_create
    from core.models import Event, Project
    from core.services import project_create
    from jobs.models import Job
    from runs import services
    from runs.services import escalations
    from runs.models import SETTLED_RUN_STATES, Run, RunAttempt, Step

    rng = random.Random(7)
    now = timezone.now()
    started = time.perf_counter()
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA synchronous=OFF")

    organizations, projects = [], []
    for n in range(ORGANIZATIONS):
        organization, project, _, _ = organization_create(name=f"bench-org-{n}", owner_username=f"bench-owner-{n}",
                                                          credits=10**12)
        organizations.append(organization)
        projects.append(project)
        for extra in ("etl", "reports"):
            projects.append(project_create(organization=organization, name=extra))
    small = project_create(organization=organizations[0], name="small")

    # Showcase runs, through the services: a tree, ledger entries, events, an escalation.
    plan = {"agents": [{"name": f"agent-{a}", "tasks": [
        {"name": f"task-{t}", "steps": [{"name": f"step-{s}", "tool": "echo", "args": {"text": "bench"}}
                                        for s in range(3)]} for t in range(3)]} for a in range(2)]}
    showcase = []
    for name in ("showcase completed", "showcase running"):
        run = services.run_create(project=projects[0], name=name, plan=plan, credit_limit=100)
        services.run_start(run_id=run.pk)
        services.run_mark_running(run_id=run.pk)
        steps = list(Step.objects.filter(run=run).order_by("pk"))
        for step in steps if name.endswith("completed") else steps[:4]:
            attempt = services.step_begin(step_id=step.pk)
            services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True})
        showcase.append(run.pk)
    escalations.escalation_open(run=Run.objects.get(pk=showcase[1]), trigger="manual", detail="bench escalation")
    print(f"  tenancy and showcase runs through the services: {time.perf_counter() - started:.1f} s", file=out)

    # Runs (with explicit ids), their attempts and one event each, in bulk.
    statuses = [status for status, share in STATUS_MIX for _ in range(round(share * 1000))]
    run_plan = {"agents": [{"name": "a", "tasks": [{"name": "t", "steps": [
        {"name": "s", "tool": "echo", "args": {"text": "bench"}}]}]}]}
    project_org = {project.pk: project.organization_id for project in Project.objects.all()}
    big_projects = [project.pk for project in projects]
    run_writer = RowWriter(Run, ["id", "organization_id", "project_id", "name", "plan", "status", "credit_limit",
                                 "credits_reserved", "credits_charged", "credits_refunded", "last_error_code",
                                 "last_error", "created_at", "status_changed_at", "started_at", "completed_at",
                                 "cancelled_at", "last_heartbeat"], now)
    attempt_writer = RowWriter(RunAttempt, ["run_id", "number", "credits_reserved", "credits_charged",
                                            "credits_refunded", "outcome", "error_code", "created_at", "ended_at"],
                               now)
    event_writer = RowWriter(Event, ["type", "organization_id", "project_id", "run_id", "payload", "created_at"], now)
    ledger_writer = RowWriter(LedgerEntry, ["organization_id", "run_id", "attempt_number", "kind", "source",
                                            "amount", "idempotency_key", "actor_label", "reason", "balance_after",
                                            "reserved_after", "prev_hash", "entry_hash", "created_at"], now)
    per_run, extra = divmod(max(0, ledger - LedgerEntry.objects.count()), runs)
    next_id = (Run.objects.order_by("-pk").values_list("pk", flat=True).first() or 0) + 1
    made = written = 0 if connection.vendor != "postgresql" else runs
    if connection.vendor == "postgresql":
        seed_bulk_postgres(runs=runs, ledger=ledger, next_id=next_id, small_project=small.pk, projects=big_projects,
                           project_org=project_org, first_org=organizations[0].pk, first_project=projects[0].pk,
                           now=now, out=out)
    while made < runs:
        run_rows, attempt_rows, event_rows, ledger_rows = [], [], [], []
        for index in range(made, min(runs, made + BATCH)):
            status = statuses[rng.randrange(len(statuses))]
            if index < SMALL_PROJECT_RUNS:
                project_id, status = small.pk, "completed"
            else:
                project_id = big_projects[index % len(big_projects)]
            organization_id = project_org[project_id]
            run_id = next_id + index
            created = now - timedelta(seconds=rng.randrange(30 * 86400))
            changed = min(now, created + timedelta(seconds=rng.randrange(1, 3600)))
            charged = rng.randrange(0, 100) if status not in ("created", "pending") else 0
            settled = status in SETTLED_RUN_STATES
            reserved = 0 if status == "created" else 100
            refunded = reserved - charged if settled else 0
            code = rng.choice(ERROR_CODES) if status in ("failed", "cancelled") else ""
            run_rows.append((
                run_id, organization_id, project_id, f"bench run {index}", run_plan, status, 100, reserved, charged,
                refunded, code, f"{code}: bench" if code else "", created, changed,
                created if status not in ("created", "pending") else None,
                changed if status == "completed" else None, changed if status == "cancelled" else None,
                now - timedelta(seconds=rng.randrange(0, 120)) if status == "running" else None))
            event_rows.append((f"run_{status}", organization_id, project_id, run_id, {"to": status}, changed))
            if status == "created":
                continue
            attempt_rows.append((run_id, 1, reserved, charged, refunded, status if settled else "", code, created,
                                 changed if settled else None))
            entries = per_run + (1 if index < extra else 0)
            for n in range(entries):
                kind = "reserve" if n == 0 else ("refund" if n == entries - 1 and settled else "charge")
                ledger_rows.append((organization_id, run_id, 1, kind, "reservation" if kind == "refund" else "",
                                    100 if kind == "reserve" else 1, f"bench:{n}", "system", "bench", 10**12, 100,
                                    "", "bench-unchained", created + timedelta(seconds=n)))
        with transaction.atomic():
            run_writer.write(run_rows)
            attempt_writer.write(attempt_rows)
            event_writer.write(event_rows)
            written += ledger_writer.write(ledger_rows)
        made += len(run_rows)
        print(f"\r  runs: {made:,}/{runs:,}, ledger entries: {written:,}", end="", file=out, flush=True)
    missing = ledger - LedgerEntry.objects.count()
    if missing > 0 and connection.vendor != "postgresql":  # created runs hold no entries: give their share to the first runs, as extra charges
        charged = Run.objects.filter(status="completed", pk__gte=next_id).order_by("pk").values_list(
            "pk", "organization_id", "created_at")[:missing]
        ledger_rows = [(organization_id, run_id, 1, "charge", "", 1, "bench:extra", "system", "bench", 10**12, 100, "",
                        "bench-unchained", created) for run_id, organization_id, created in charged]
        with transaction.atomic():
            written += ledger_writer.write(ledger_rows)
    print(f" ({time.perf_counter() - started:.1f} s)", file=out)

    # The queue: a day of completed jobs, a few failed ones, some waiting (made above on PostgreSQL).
    job_writer = RowWriter(Job, ["type", "organization_id", "project_id", "run_id", "state", "reason", "lane",
                                 "payload", "attempts", "created_at", "queued_at", "started_at", "completed_at"], now)
    job_rows = []
    for index in range(20_000):
        at = now - timedelta(seconds=rng.randrange(86400))
        state = "failed" if index % 50 == 0 else "completed"
        run_id = next_id + index % runs
        job_rows.append(("run_step", organizations[0].pk, projects[0].pk, run_id, state,
                         "fatal_error" if state == "failed" else "completed", f"run:{run_id}", {}, 1, at, at, at, at))
    for index in range(50):
        job_rows.append(("noop", organizations[0].pk, projects[0].pk, None, "queued", "", f"project:{index % 7}", {},
                         0, now, now, None, None))
    if connection.vendor != "postgresql":
        with transaction.atomic():
            job_writer.write(job_rows)

    # Credits held by the live runs, as the accounts would say.
    for organization in organizations:
        held = sum(row[0] - row[1] - row[2] for row in Run.objects.filter(
            organization=organization, status__in=["pending", "running", "paused"]).values_list(
            "credits_reserved", "credits_charged", "credits_refunded"))
        CreditAccount.objects.filter(organization=organization).update(reserved=held)
    with connection.cursor() as cursor:
        for sql in connection.ops.sequence_reset_sql(no_style(), [Run]):
            cursor.execute(sql)  # PostgreSQL: the run ids were given explicitly
        cursor.execute("ANALYZE")
    print(f"  seeded in {time.perf_counter() - started:.1f} s", file=out)
    return {"showcase": showcase}


# --- measuring ----------------------------------------------------------------------------------

def goal_ratio(name: str) -> float | None:
    """The most a page may cost, as a multiple of the empty changelist (None: no goal)."""
    if "change page" in name or "baseline" in name:
        return None
    return 5.0 if "?q=" in name else 3.0


def measure(client, url: str, repeat: int) -> dict:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        response = client.get(url)  # warm-up, and the query count
    query_count = len(queries.captured_queries)  # read now: the next request empties the log
    if response.status_code != 200:
        raise SystemExit(f"{url} answered {response.status_code}")
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        response = client.get(url)
        times.append((time.perf_counter() - started) * 1000)
    return {"url": url, "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "queries": query_count, "bytes": len(response.content)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100_000, help="runs in the database (default 100,000)")
    parser.add_argument("--ledger", type=int, default=1_000_000, help="ledger entries (default 1,000,000)")
    parser.add_argument("--repeat", type=int, default=7, help="renders per page; the median is shown (default 7)")
    parser.add_argument("--db", default=str(DEFAULT_SQLITE), help=f"SQLite file (default {DEFAULT_SQLITE})")
    parser.add_argument("--fresh", action="store_true", help="rebuild the bench database even if it is seeded")
    args = parser.parse_args()
    if args.runs < 100 or args.ledger < 0 or args.repeat < 1:
        parser.error("--runs must be at least 100, --ledger at least 0 and --repeat at least 1")

    os.environ["DJANGO_SETTINGS_MODULE"] = "orchestrator_site.settings"
    os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "testserver,localhost,127.0.0.1")
    label, recreate = prepare_environment(args)

    import django

    django.setup()
    logging.disable(logging.INFO)  # one structured line per transition would drown the figures
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client
    from django.urls import reverse

    from runs import services
    from runs.models import Run

    services.RUN_DISPATCHERS.clear()  # nothing here is meant to execute
    out = sys.stdout
    if args.fresh or not seeded(args.runs, args.ledger):
        print(f"seeding {label}: {args.runs:,} runs, {args.ledger:,} ledger entries", file=out)
        recreate()
        call_command("migrate", verbosity=0, interactive=False)
        seed(runs=args.runs, ledger=args.ledger, out=out)
    else:
        call_command("migrate", verbosity=0, interactive=False)
        print(f"reusing {label} (--fresh rebuilds it)", file=out)

    from django.contrib.auth import get_user_model

    from billing.models import LedgerEntry
    from core.models import Event, Project

    user, _ = get_user_model().objects.get_or_create(username="bench-admin",
                                                     defaults={"is_staff": True, "is_superuser": True})
    client = Client()
    client.force_login(user)
    counts = {"runs": Run.objects.count(), "ledger": LedgerEntry.objects.count()}
    counts["ledger_mid"] = LedgerEntry.objects.order_by("pk").values_list("pk", flat=True)[counts["ledger"] // 2]
    showcase = Run.objects.filter(name="showcase running").values_list("pk", flat=True).first()
    middle = Run.objects.filter(name=f"bench run {counts['runs'] // 2}").values_list("pk", flat=True).first() \
        or Run.objects.order_by("pk").values_list("pk", flat=True)[counts["runs"] // 2]
    small = Project.objects.filter(name="small").values_list("pk", flat=True).first()
    big = Project.objects.filter(name="etl").values_list("pk", flat=True).first()
    runs_url = reverse("admin:runs_run_changelist")
    deep_page = max(2, min(settings.ORCHESTRATOR_ADMIN_MAX_PAGES, counts["runs"] // 100 // 2))
    pages = [
        ("empty changelist (baseline)", reverse("admin:jobs_deployment_changelist")),
        ("run changelist", runs_url),
        ("run changelist ?status=failed", f"{runs_url}?status__exact=failed"),
        ("run changelist ?stuck=yes", f"{runs_url}?stuck=yes"),
        ("run changelist ?error code", f"{runs_url}?last_error_code=timeout"),
        ("run changelist ?q=name", f"{runs_url}?q=bench+run+4242"),
        (f"run changelist page {deep_page}", f"{runs_url}?p={deep_page}"),
        ("run changelist older (mid-table)", f"{runs_url}?cursor={middle}"),
        ("run changelist ?project", f"{runs_url}?project__id__exact={big}"),
        ("run changelist ?escalated=yes", f"{runs_url}?escalated=yes"),
        ("run changelist ?q=error", f"{runs_url}?q=heartbeat_timeout"),
        ("run change page", reverse("admin:runs_run_change", args=[middle])),
        ("run change page (tree)", reverse("admin:runs_run_change", args=[showcase])),
        ("ledger changelist", reverse("admin:billing_ledgerentry_changelist")),
        ("ledger changelist ?kind=charge", reverse("admin:billing_ledgerentry_changelist") + "?kind__exact=charge"),
        ("ledger changelist older (mid-table)", reverse("admin:billing_ledgerentry_changelist")
         + f"?cursor={counts['ledger_mid']}"),
        ("job changelist", reverse("admin:jobs_job_changelist")),
        ("operations dashboard", reverse("dashboard:index")),
        ("dashboard JSON", reverse("dashboard:data")),
    ]
    print(f"database: {label}, {connection.vendor}; {counts['runs']:,} runs, {counts['ledger']:,} ledger entries; "
          f"median of {args.repeat} renders after a warm-up, Django test client, in process", file=out)
    results = [(name, measure(client, url, args.repeat)) for name, url in pages]
    baseline = results[0][1]
    print(f"\n{'page':36} {'median ms':>10} {'x empty':>8} {'goal':>6} {'queries':>8} {'min..max ms':>16} "
          f"{'KiB':>6}", file=out)
    over = []
    for name, result in results:
        ratio = result["median_ms"] / baseline["median_ms"]
        goal = goal_ratio(name)
        verdict = "" if goal is None else (f"{goal:.0f}x ok" if ratio <= goal else f"{goal:.0f}x OVER")
        if goal is not None and ratio > goal:
            over.append(name)
        print(f"{name:36} {result['median_ms']:10.1f} {ratio:8.1f} {verdict:>9} {result['queries']:5d} "
              f"{result['min_ms']:7.1f}..{result['max_ms']:<7.1f} {result['bytes'] / 1024:6.0f}", file=out)
    print(f"\npages over their goal: {', '.join(over) if over else 'none'}", file=out)

    # The API's large collections, as a member of the first organization (a tenth of the rows),
    # next to the trivial endpoint: the first page and a deep one (by cursor; events by after=).
    owner = get_user_model().objects.get(username="bench-owner-0")
    api = Client()
    api.force_login(owner)
    mine = Run.objects.filter(organization__memberships__user=owner).order_by("-pk").values_list("pk", flat=True)
    deep_run = mine[len(mine) // 2] if mine else 1
    first_event = Event.objects.filter(run_id=deep_run).values_list("pk", flat=True).first() or 0
    api_pages = [("API ping (baseline)", "/api/v1/ping/"), ("API runs", "/api/v1/runs/"),
                 ("API ledger", "/api/v1/ledger/"), ("API jobs", "/api/v1/jobs/"),
                 ("API events", "/api/v1/events/?limit=50")]
    results = [(name, measure(api, url, args.repeat)) for name, url in api_pages]
    for name, url in [("API runs deep (cursor)", "/api/v1/runs/"), ("API ledger deep (cursor)", "/api/v1/ledger/")]:
        page = api.get(url).json()
        for _ in range(3):  # a page four cursors in (a cursor page reads the same rows at any depth)
            page = api.get(page["next"]).json()
        results.append((name, measure(api, page["next"], args.repeat)))
    results.append(("API events deep (after=)", measure(api, f"/api/v1/events/?limit=50&after={first_event}",
                                                        args.repeat)))
    baseline = results[0][1]
    print(f"\n{'API page':36} {'median ms':>10} {'x ping':>8} {'goal':>6} {'queries':>8}", file=out)
    for name, result in results:
        ratio = result["median_ms"] / baseline["median_ms"]
        goal = "" if "baseline" in name else ("3x ok" if ratio <= 3 else "3x OVER")
        print(f"{name:36} {result['median_ms']:10.1f} {ratio:8.1f} {goal:>9} {result['queries']:5d}", file=out)

    # Bounded queries: a page of 100 runs against a project of 10 runs, same changelist.
    full = measure(client, runs_url, 1)
    few = measure(client, f"{runs_url}?project__id__exact={small}", 1) if small else None
    if few is not None:
        verdict = "bounded (no query per row)" if full["queries"] == few["queries"] else "NOT bounded"
        print(f"\nrun changelist queries: {full['queries']} for 100 rows shown, {few['queries']} for "
              f"{SMALL_PROJECT_RUNS} rows shown: {verdict}", file=out)
        return 0 if full["queries"] == few["queries"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
