"""Seeding of the console benchmark's database (``bench/admin.py``): bulk-inserted runs, attempts,
jobs, events and ledger entries with plausible values (``generate_series`` on PostgreSQL, plain
``executemany`` on SQLite), plus a handful of runs made through the services so the change pages
show real data. See ``bench/admin.py`` for what it is measured with and what it does not exercise.
"""

from __future__ import annotations

import random
import time
from datetime import timedelta

ORGANIZATIONS = 10
SMALL_PROJECT_RUNS = 10
ERROR_CODES = ["timeout", "heartbeat_timeout", "tool_failed", "gate_failed:publish", "force_failed",
               "insufficient_credits", "fatal_error", "worker_lost"]
# (status, share of runs)
STATUS_MIX = [("completed", 0.70), ("failed", 0.15), ("cancelled", 0.05), ("running", 0.04), ("pending", 0.03),
              ("paused", 0.02), ("created", 0.01)]
BATCH = 5_000


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
    from django.db import connection, transaction

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
    with connection.cursor() as cursor:
        # The ledger's foreign-key checks (deferred to the commit) run a plan this session cached
        # while the runs table held the two showcase runs: a sequential scan, a million times over
        # a hundred thousand runs. Fresh statistics invalidate it (autovacuum does the same, but
        # only after a while: a slow insert of a million runs gave it the time, a quick one not).
        cursor.execute(f"ANALYZE {Run._meta.db_table}")
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
        # A bulk-loaded table is not a table in use: VACUUM sets its visibility map (what index-only
        # scans read) as autovacuum would in a while; SQLite has neither.
        cursor.execute("VACUUM ANALYZE" if connection.vendor == "postgresql" else "ANALYZE")
    print(f"  seeded in {time.perf_counter() - started:.1f} s", file=out)
    return {"showcase": showcase}
