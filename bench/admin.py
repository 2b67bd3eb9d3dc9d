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
    from runs import escalations, services
    from runs.models import Run, RunAttempt, Step

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
    settled_states = ("completed", "failed", "cancelled")
    per_run, extra = divmod(max(0, ledger - LedgerEntry.objects.count()), runs)
    next_id = (Run.objects.order_by("-pk").values_list("pk", flat=True).first() or 0) + 1
    made = written = 0
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
            settled = status in settled_states
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
    if missing > 0:  # created runs hold no entries: give their share to the first runs, as extra charges
        charged = Run.objects.filter(status="completed", pk__gte=next_id).order_by("pk").values_list(
            "pk", "organization_id", "created_at")[:missing]
        ledger_rows = [(organization_id, run_id, 1, "charge", "", 1, "bench:extra", "system", "bench", 10**12, 100, "",
                        "bench-unchained", created) for run_id, organization_id, created in charged]
        with transaction.atomic():
            written += ledger_writer.write(ledger_rows)
    print(f" ({time.perf_counter() - started:.1f} s)", file=out)

    # The queue: a day of completed jobs, a few failed ones, some waiting.
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
    from core.models import Project

    user, _ = get_user_model().objects.get_or_create(username="bench-admin",
                                                     defaults={"is_staff": True, "is_superuser": True})
    client = Client()
    client.force_login(user)
    counts = {"runs": Run.objects.count(), "ledger": LedgerEntry.objects.count()}
    showcase = Run.objects.filter(name="showcase running").values_list("pk", flat=True).first()
    middle = Run.objects.filter(name=f"bench run {counts['runs'] // 2}").values_list("pk", flat=True).first() \
        or Run.objects.order_by("pk").values_list("pk", flat=True)[counts["runs"] // 2]
    small = Project.objects.filter(name="small").values_list("pk", flat=True).first()
    runs_url = reverse("admin:runs_run_changelist")
    deep_page = max(2, min(500, counts["runs"] // 100 // 2))
    pages = [
        ("empty changelist (baseline)", reverse("admin:jobs_deployment_changelist")),
        ("run changelist", runs_url),
        ("run changelist ?status=failed", f"{runs_url}?status__exact=failed"),
        ("run changelist ?stuck=yes", f"{runs_url}?stuck=yes"),
        ("run changelist ?error code", f"{runs_url}?last_error_code=timeout"),
        ("run changelist ?q=name", f"{runs_url}?q=bench+run+4242"),
        (f"run changelist page {deep_page}", f"{runs_url}?p={deep_page}"),
        ("run change page", reverse("admin:runs_run_change", args=[middle])),
        ("run change page (tree)", reverse("admin:runs_run_change", args=[showcase])),
        ("ledger changelist", reverse("admin:billing_ledgerentry_changelist")),
        ("operations dashboard", reverse("dashboard:index")),
        ("dashboard JSON", reverse("dashboard:data")),
    ]
    print(f"database: {label}, {connection.vendor}; {counts['runs']:,} runs, {counts['ledger']:,} ledger entries; "
          f"median of {args.repeat} renders after a warm-up, Django test client, in process", file=out)
    results = [(name, measure(client, url, args.repeat)) for name, url in pages]
    baseline = results[0][1]
    print(f"\n{'page':34} {'median ms':>10} {'x empty':>8} {'queries':>8} {'x empty':>8} {'min..max ms':>16} "
          f"{'KiB':>6}", file=out)
    for name, result in results:
        print(f"{name:34} {result['median_ms']:10.1f} {result['median_ms'] / baseline['median_ms']:8.1f} "
              f"{result['queries']:8d} {result['queries'] / baseline['queries']:8.1f} "
              f"{result['min_ms']:7.1f}..{result['max_ms']:<7.1f} {result['bytes'] / 1024:6.0f}", file=out)

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
