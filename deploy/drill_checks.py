"""The drill's checks (``deploy/drill.py``): each reads the database (or the clients, or the
processes) after the drill and returns a table row that holds or not.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import timedelta

from deploy.stack import BASE_DIR, Deployment


def database_errors() -> tuple[type[BaseException], ...]:
    """What a database outage raises (a lost or refused connection), not what a bug raises."""
    import psycopg
    from django.db import InterfaceError, OperationalError

    return (OperationalError, InterfaceError, psycopg.OperationalError, psycopg.InterfaceError)


def with_database(fn, *, timeout: float = 120):
    """Call ``fn`` until it gets through a database outage (reconnecting between tries)."""
    from django.db import connection

    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except database_errors():
            connection.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)


@dataclass
class Row:
    what: str
    count: str
    detail: str
    held: bool | None = None  # None: an action, not a check


def check_runs(run_ids: list[int], settled: bool) -> Row:
    from django.utils import timezone

    from jobs.models import TERMINAL_JOB_STATES, Job
    from runs.models import SETTLED_RUN_STATES, Run

    statuses = Counter()
    progressing = stuck = 0
    stuck_ids: list[int] = []
    recent = timezone.now() - timedelta(seconds=60)
    for run in Run.objects.filter(pk__in=run_ids):
        statuses[run.status] += 1
        if run.status in SETTLED_RUN_STATES:
            continue
        live_job = Job.objects.filter(run_id=run.pk).exclude(state__in=list(TERMINAL_JOB_STATES)).exists()
        if live_job or (run.last_heartbeat and run.last_heartbeat >= recent):
            progressing += 1
        else:
            stuck += 1
            stuck_ids.append(run.pk)
    missing = len(run_ids) - sum(statuses.values())
    detail = ", ".join(f"{status} {n}" for status, n in sorted(statuses.items()))
    if progressing:
        detail += f"; {progressing} still progressing"
    if stuck:
        detail += f"; stuck: {stuck_ids[:10]}"
    if missing:
        detail += f"; {missing} submitted runs missing"
    if not settled:
        detail += "; quiescence not reached in time"
    failed = Run.objects.filter(pk__in=run_ids, status=Run.Status.FAILED).values_list("last_error_code", flat=True)
    if failed:
        detail += f"; failure codes {dict(Counter(failed))}"
    return Row("every run settled or still progressing", str(len(run_ids)), detail,
               held=not stuck and not missing)


def check_jobs(probe_ids: list[int], load_error: BaseException | None) -> list[Row]:
    from django.db.models import Count

    from core.models import Event
    from jobs.events import JOB_CANCELLED, JOB_COMPLETED, JOB_FAILED, JOB_STARTED
    from jobs.models import TERMINAL_JOB_STATES, Job, JobState

    rows: list[Row] = []
    jobs = Job.objects.all()
    open_jobs = jobs.exclude(state__in=list(TERMINAL_JOB_STATES))
    missing = set(probe_ids) - set(Job.objects.filter(pk__in=probe_ids).values_list("pk", flat=True))
    states = Counter(jobs.values_list("state", flat=True))
    failed = Counter(jobs.filter(state=JobState.FAILED).values_list("type", "reason"))
    probes_completed = Job.objects.filter(pk__in=probe_ids, state=JobState.COMPLETED).count()
    detail = (f"{sum(states.values())} jobs: " + ", ".join(f"{s} {n}" for s, n in sorted(states.items()))
              + f"; probe jobs completed {probes_completed}/{len(probe_ids)}")
    if failed:
        detail += f"; failed {dict((f'{t}:{r}', n) for (t, r), n in failed.items())}"
    if missing:
        detail += f"; submitted but missing: {sorted(missing)[:10]}"
    if load_error is not None:
        detail += f"; the load stopped on {type(load_error).__name__}: {load_error}"
    lost_probes = len(probe_ids) - probes_completed
    rows.append(Row("no job lost", str(sum(states.values())), detail,
                    held=not missing and not open_jobs.exists() and lost_probes == 0 and load_error is None))

    # Each claim is one (job, attempt): a second "started" event for the same pair is a double claim.
    claims = Counter(Event.objects.filter(type=JOB_STARTED)
                     .values_list("payload__jobId", "payload__attempts"))
    doubled = [key for key, n in claims.items() if n > 1]
    finished = (Event.objects.filter(type__in=[JOB_COMPLETED, JOB_FAILED, JOB_CANCELLED])
                .values("payload__jobId").annotate(n=Count("id")).filter(n__gt=1))
    detail = f"{len(claims)} claims; {len(doubled)} claimed twice; {finished.count()} jobs finished twice"
    rows.append(Row("no job claimed or finished twice", str(len(claims)), detail,
                    held=not doubled and not finished.exists()))

    # Probe jobs record each execution: one per claim, never two for one attempt.
    executions = Counter(Event.objects.filter(type="job_probe_executed")
                         .values_list("payload__jobId", "payload__attempt"))
    twice = [key for key, n in executions.items() if n > 1]
    unclaimed = [key for key in executions if key not in claims]
    rerun = Counter(job_id for job_id, _ in executions)
    rerun_jobs = sum(1 for n in rerun.values() if n > 1)
    detail = (f"{sum(executions.values())} probe executions; {len(twice)} attempts executed twice; "
              f"{len(unclaimed)} without a claim; {rerun_jobs} jobs ran again after their worker or its "
              "connection was lost")
    rows.append(Row("no job executed twice", str(sum(executions.values())), detail, held=not twice and not unclaimed))
    return rows


def check_side_effects(run_ids: list[int]) -> Row:
    from django.db.models import Count

    from jobs.models import AdapterCall, Deployment
    from runs.models import Run

    by_name = Counter(dict(Deployment.objects.values_list("name").annotate(n=Count("id")).values_list("name", "n")))
    doubled = {name: n for name, n in by_name.items() if n > 1}
    created = (AdapterCall.objects.filter(operation="create_deployment", outcome="created")
               .values("idempotency_key").annotate(n=Count("id")).filter(n__gt=1))
    completed = Run.objects.filter(pk__in=run_ids, status=Run.Status.COMPLETED).values_list("name", flat=True)
    expected = {f"drill-{name.split()[-1]}-a{agent}" for name in completed for agent in range(2)}
    missing = expected - set(by_name)
    replays = AdapterCall.objects.filter(operation="create_deployment").exclude(outcome="created").count()
    detail = (f"{sum(by_name.values())} deployments for {len(expected)} deploy steps of completed runs; "
              f"{len(doubled)} made twice; {len(missing)} missing; {replays} replays answered from the record")
    return Row("every side effect made once", str(sum(by_name.values())), detail,
               held=not doubled and not created.exists() and not missing)


def check_invariants_command(env: dict[str, str]) -> Row:
    result = subprocess.run([sys.executable, "manage.py", "check_invariants"], cwd=BASE_DIR, env=env,
                            capture_output=True, text=True, timeout=300)
    lines = (result.stdout + result.stderr).strip().splitlines()
    detail = f"exit {result.returncode}: " + ("; ".join(lines[-3:]) if lines else "(no output)")
    return Row("check_invariants exits 0", "1", detail, held=result.returncode == 0)


def check_clients(clients, start_id: int, end_id: int) -> Row:
    from core.models import Event

    expected: dict[int, list[int]] = defaultdict(list)
    for event_id, project_id in (Event.objects.filter(id__gt=start_id, id__lte=end_id, project_id__isnull=False)
                                 .order_by("id").values_list("id", "project_id")):
        expected[project_id].append(event_id)
    equal = 0
    problems: list[str] = []
    missed: set[int] = set()
    for client in clients.clients:
        got = [i for i in client.ids() if i <= end_id]
        want = expected[client.subscription["project"]]
        if got == want:
            equal += 1
            continue
        duplicates = len(got) - len(set(got))
        gaps = sorted(set(want) - set(got))
        missed.update(gaps)
        extra = sorted(set(got) - set(want))
        problems.append(f"client {client.index}: {len(gaps)} missing {gaps[:5]}, {duplicates} duplicated, "
                        f"{len(extra)} unexpected")
    reconnects = sum(client.connects - 1 for client in clients.clients)
    unexpected = sum(client.unexpected_closes for client in clients.clients)
    events = sum(len(client.events) for client in clients.clients)
    detail = (f"{equal}/{len(clients.clients)} clients equal the database ({events} events received, "
              f"{reconnects} reconnections, {unexpected} of them after an unplanned close)")
    if problems:
        detail += "; " + "; ".join(problems[:3])
    if missed:
        rows = Event.objects.filter(id__in=sorted(missed)[:10]).values_list("id", "type", "run_id", "created_at")
        detail += "; missed events: " + ", ".join(f"{i} {t} run {r} at {c:%H:%M:%S.%f}" for i, t, r, c in rows)
    return Row("every client's events equal the database", str(len(clients.clients)), detail,
               held=equal == len(clients.clients))


def check_processes(deployment: Deployment) -> Row:
    exited = deployment.exited()
    detail = "all running" if not exited else ", ".join(f"{c.name} exited {c.process.returncode}" for c in exited)
    return Row("every deployment process still running", str(len(deployment.children())), detail, held=not exited)


def print_table(title: str, rows: list[Row]) -> None:
    widths = [max(len(r.what) for r in rows), max(len(r.count) for r in rows)]
    print(f"\n{title}")
    status_width = 4 if any(r.held is not None for r in rows) else 0
    rule = "-" * (widths[0] + widths[1] + status_width + 60)
    print(rule)
    for row in rows:
        status = ("    " if row.held is None else ("ok  " if row.held else "FAIL")) if status_width else ""
        print(f"{status}{' ' if status else ''}{row.what:<{widths[0]}}  {row.count:>{widths[1]}}  {row.detail}")
    print(rule, flush=True)


# --- main --------------------------------------------------------------------------------------


def wait_quiescent(run_ids: list[int], timeout: float) -> bool:
    """Wait until every run is terminal and no job is open; False when ``timeout`` passed first."""
    from jobs.models import TERMINAL_JOB_STATES, Job
    from runs.models import SETTLED_RUN_STATES, Run

    def quiet():
        open_runs = Run.objects.filter(pk__in=run_ids).exclude(status__in=list(SETTLED_RUN_STATES))
        return not open_runs.exists() and not Job.objects.exclude(state__in=list(TERMINAL_JOB_STATES)).exists()

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if with_database(quiet):
            return True
        time.sleep(0.5)
    return False


def project_targets(clients, start_id: int, end_id: int) -> dict[int, int]:
    """For each client, the last event id of its project up to ``end_id``."""
    from django.db.models import Max

    from core.models import Event

    last = dict(Event.objects.filter(id__gt=start_id, id__lte=end_id, project_id__isnull=False)
                .values_list("project_id").annotate(m=Max("id")).values_list("project_id", "m"))
    return {client.index: last.get(client.subscription["project"], start_id) for client in clients.clients}

