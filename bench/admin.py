"""Benchmark: the console's run pages with 100,000 runs and 1,000,000 ledger entries.

    .venv/bin/python bench/admin.py [--runs 100000] [--ledger 1000000] [--repeat 7] [--db PATH] [--fresh]

Renders, in process through Django's test client as a logged-in superuser, and prints the median
render time of ``--repeat`` renders (after one warm-up) and the query count of: the run
changelist (plain, filtered by status, by the "stuck" filter, by an error code, a name search
and a deep page), the run change page (a run with its ledger entries, and a run with an agent →
task → step tree, events and an escalation), the ledger changelist, the operations dashboard and
its JSON snapshot — each next to Django's empty changelist (the deployments list, which has no
rows) rendered in the same run, as ratios. It also checks that the run changelist's query count
does not depend on the number of rows shown (a full page of runs against a project of 10).

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
import statistics  # noqa: E402
import time  # noqa: E402
from urllib.parse import urlsplit, urlunsplit  # noqa: E402

from bench.admin_seed import SMALL_PROJECT_RUNS, seed, seeded  # noqa: E402

BENCH_DATABASE = "orchestrator_bench_admin"
DEFAULT_SQLITE = ROOT / "var" / "bench_admin.sqlite3"


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
        page, deep = api.get(url).json(), url
        for _ in range(4):  # a page four cursors in (a cursor page reads the same rows at any depth)
            if not page["next"]:
                break  # a small database: the deepest page there is
            deep = page["next"]
            page = api.get(deep).json()
        results.append((name, measure(api, deep, args.repeat)))
    results.append(("API events deep (after=)", measure(api, f"/api/v1/events/?limit=50&after={first_event}",
                                                        args.repeat)))
    baseline = results[0][1]
    print(f"\n{'API page':36} {'median ms':>10} {'x ping':>8} {'goal':>6} {'queries':>8}", file=out)
    for name, result in results:
        ratio = result["median_ms"] / baseline["median_ms"]
        goal = "" if "baseline" in name else ("3x ok" if ratio <= 3 else "3x OVER")
        print(f"{name:36} {result['median_ms']:10.1f} {ratio:8.1f} {goal:>9} {result['queries']:5d}", file=out)

    # Bounded queries: a full page of runs against a project of 10 runs, same changelist.
    full = measure(client, runs_url, 1)
    few = measure(client, f"{runs_url}?project__id__exact={small}", 1) if small else None
    if few is not None:
        verdict = "bounded (no query per row)" if full["queries"] == few["queries"] else "NOT bounded"
        print(f"\nrun changelist queries: {full['queries']} for a full page, {few['queries']} for "
              f"{SMALL_PROJECT_RUNS} rows shown: {verdict}", file=out)
        return 0 if full["queries"] == few["queries"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
