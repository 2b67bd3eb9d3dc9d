"""Reliability drills against a one-machine scale-out, under a steady load of runs.

    .venv/bin/python -m deploy.drill [--quick] [--kills N] [--load-seconds S] [--clients N]

Starts two ``qcluster`` and two daphne processes (``deploy.stack``) on a scratch database and
the Redis broker, connects WebSocket clients (half on each daphne, each following a project),
and while runs and probe jobs keep arriving:

  (a) kills a worker process that is executing a job with ``kill -9``, N times (default 20);
  (b) restarts PostgreSQL once;
  (c) sends SIGTERM to a cluster, waits for it to stop, and starts it again;
  (d) resets the sockets of every client at once (50 by default); each reconnects to the
      other daphne and resubscribes with ``after`` = the last event it received.

Then it stops the load, waits for quiescence and checks: every run settled (completed, failed
or cancelled) or still progressing; no job lost, claimed twice or executed twice (one execution
per claim: a job whose worker was killed, or lost its connection, runs again as a new attempt);
every side effect (a deployment) made once; ``check_invariants`` exits 0; every client's events
equal the database's. It prints what it did and what held, and exits 1 if anything did not
hold. ``--quick`` is the bounded form CI runs (fewer kills, a shorter load). It restarts the
PostgreSQL server it uses: never point it at a server others are using.

Environment:
  DRILL_DATABASE_URL  scratch database, dropped and created (default
                      postgres://postgres@127.0.0.1:5432/orchestrator_drill)
  DRILL_REDIS_URL     Redis database for the broker, flushed (default redis://127.0.0.1:6379/13)
  DRILL_PG_CLUSTER    the PostgreSQL cluster to restart, as VERSION/NAME (default: the local
                      cluster listening on the database URL's port)
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from deploy.drill_checks import (
    Row,
    check_clients,
    check_invariants_command,
    check_jobs,
    check_processes,
    check_runs,
    check_side_effects,
    database_errors,
    print_table,
    project_targets,
    wait_quiescent,
    with_database,
)
from deploy.stack import (
    BASE_DIR,
    Deployment,
    StackError,
    ensure_postgres,
    ensure_redis,
    flush_redis,
    free_port,
    postgres_cluster_for,
    python_env,
    recreate_database,
    restart_postgres,
    stack_stop,
    wait_postgres,
)

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/orchestrator_drill"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/13"
PROJECTS = 5

# The deployment under drill: leases short enough that a killed worker's job is recovered in
# seconds, every worker allowed to run at once, queue caps out of the way of the load.
DEPLOYMENT_ENV = {
    "ORCHESTRATOR_Q_NAME": "drill",
    "ORCHESTRATOR_Q_WORKERS": "2",
    "ORCHESTRATOR_Q_TIMEOUT_S": "60",
    "ORCHESTRATOR_Q_RETRY_S": "90",
    "ORCHESTRATOR_QUEUE_GLOBAL_CONCURRENCY": "4",
    "ORCHESTRATOR_QUEUE_LEASE_S": "5",
    "ORCHESTRATOR_QUEUE_MAINTENANCE_INTERVAL_MS": "250",
    "ORCHESTRATOR_QUEUE_DRAIN_MAX_S": "5",
    "ORCHESTRATOR_QUEUE_MAX_PER_PROJECT": "100000",
    "ORCHESTRATOR_QUEUE_MAX_GLOBAL": "100000",
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def plan_for(number: int) -> dict:
    """Two agents, each: a short sleep, a deployment (a side effect), an echo."""
    return {"agents": [
        {"name": f"a{agent}", "tasks": [{"name": "t", "steps": [
            {"name": "warm", "tool": "sleep", "args": {"seconds": 0.2}},
            {"name": "ship", "tool": "deploy", "args": {"name": f"drill-{number}-a{agent}"}},
            {"name": "note", "tool": "echo", "args": {"text": f"run {number}"}},
        ]}]} for agent in range(2)]}


# --- the steady load ---------------------------------------------------------------------------

@dataclass
class Load:
    """Creates and starts runs and enqueues probe jobs at fixed rates until stopped.

    A submission that meets a database outage is retried; before retrying it looks for what
    the failed attempt may have committed, so nothing is submitted twice.
    """

    projects: list
    run_rate: float
    probe_rate: float
    runs: list[int] = field(default_factory=list)
    probes: list[int] = field(default_factory=list)
    retried: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    error: BaseException | None = None

    def start(self) -> "Load":
        self.thread = threading.Thread(target=self._loop, name="drill-load", daemon=True)
        self.thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(180)

    def _loop(self) -> None:
        from django.db import connection

        rng = random.Random(20)
        started = time.monotonic()
        runs_done = probes_done = 0
        try:
            while not self.stop.is_set():
                elapsed = time.monotonic() - started
                if runs_done < elapsed * self.run_rate:
                    self.runs.append(self._submit(lambda n=runs_done: self._run(n)))
                    runs_done += 1
                elif probes_done < elapsed * self.probe_rate:
                    self.probes.append(self._submit(lambda n=probes_done: self._probe(n, rng.uniform(0.3, 1.0))))
                    probes_done += 1
                else:
                    time.sleep(0.02)
        except BaseException as exc:  # reported by the checks
            self.error = exc
        finally:
            connection.close()

    def _submit(self, fn) -> int:
        from django.db import connection

        deadline = time.monotonic() + 120
        while True:
            try:
                return fn()
            except database_errors():
                self.retried += 1
                connection.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.25)

    def _run(self, number: int) -> int:
        from runs import services
        from runs.models import Run

        project = self.projects[number % len(self.projects)]
        name = f"drill {number}"
        run = Run.objects.filter(project=project, name=name).first()
        if run is None:
            run = services.run_create(project=project, name=name, plan=plan_for(number))
        if run.status == Run.Status.CREATED:
            services.run_start(run_id=run.pk)
        return run.pk

    def _probe(self, number: int, seconds: float) -> int:
        from jobs.models import Job
        from jobs.services import job_enqueue

        project = self.projects[number % len(self.projects)]
        existing = Job.objects.filter(type="probe", payload__value=number).values_list("pk", flat=True).first()
        if existing:
            return existing
        payload = {"value": number, "sleep": round(seconds, 3)}
        return job_enqueue(job_type="probe", project=project, payload=payload).job.pk


# --- the drills --------------------------------------------------------------------------------

def kill_busy_workers(deployment: Deployment, times: int, spacing: float) -> tuple[Counter, list[str]]:
    """``kill -9`` a worker of the deployment while it executes a job, ``times`` times.

    Alternately a worker executing one of a run's jobs and one executing a probe job (any job
    when none of the wanted kind shows up within a few seconds); never the same job twice, so
    each kill tests a recovery, not the attempt budget; only processes below one of the
    deployment's clusters.
    """
    from django.utils import timezone

    from jobs.models import Job, JobState, WorkerHeartbeat

    host = socket.gethostname()
    killed_jobs: set[int] = set()
    killed_types: Counter = Counter()
    notes: list[str] = []
    deadline = time.monotonic() + max(120.0, times * (spacing + 6))

    def victim(want_probe: bool | None):
        fresh = timezone.now() - timedelta(seconds=3)
        beats = list(WorkerHeartbeat.objects.filter(current_job_id__isnull=False, last_seen__gte=fresh))
        random.shuffle(beats)
        for beat in beats:
            if beat.current_job_id in killed_jobs or not beat.worker.startswith(f"{host}:"):
                continue
            job = Job.objects.filter(pk=beat.current_job_id, state=JobState.EXECUTING, worker=beat.worker).first()
            if job is not None and (want_probe is None or (job.type == "probe") == want_probe):
                return beat.worker, job
        return None

    while sum(killed_types.values()) < times:
        if time.monotonic() > deadline:
            notes.append(f"found a busy worker only {sum(killed_types.values())} times in time")
            break
        wanted = sum(killed_types.values()) % 2 == 1  # odd kills: a probe job
        searching_since = time.monotonic()
        found = None
        while found is None and time.monotonic() < deadline:
            patient = time.monotonic() - searching_since < 3
            found = with_database(lambda: victim(wanted if patient else None))
            if found is None:
                time.sleep(0.05)
                continue
            pid = int(found[0].rsplit(":", 1)[1])
            if deployment.cluster_of(pid) is None:  # not (or no longer) one of ours
                found = None
        if found is None:
            continue
        worker, job = found
        try:
            os.kill(int(worker.rsplit(":", 1)[1]), signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed_jobs.add(job.pk)
        killed_types[job.type] += 1
        time.sleep(spacing)
    return killed_types, notes


def connect_clients(deployment: Deployment, token: str, projects: list, count: int, after: int):
    from deploy.clients import EventClients

    subscriptions = [{"project": projects[i % len(projects)].pk} for i in range(count)]
    urls = [deployment.ws_url(index) for index in range(len(deployment.webs))]
    return EventClients(urls, token, subscriptions, after=after).start(timeout=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.drill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the bounded form: 6 kills, a 30 s load, 1 probe job/s")
    parser.add_argument("--kills", type=int, help="kill -9 this many busy workers (default 20; 6 with --quick)")
    parser.add_argument("--load-seconds", type=float, help="at least this long a load (default 120; 30 with --quick)")
    parser.add_argument("--clients", type=int, default=50, help="WebSocket clients (default 50)")
    parser.add_argument("--run-rate", type=float, default=1.0, help="runs started per second (default 1)")
    parser.add_argument("--probe-rate", type=float, help="probe jobs per second (default 2; 1 with --quick)")
    parser.add_argument("--settle-seconds", type=float, default=180, help="longest wait for quiescence")
    parser.add_argument("--log-dir", type=Path, help="process logs (default var/drill/<time>/)")
    args = parser.parse_args(argv)
    kills = args.kills if args.kills is not None else (6 if args.quick else 20)
    load_seconds = args.load_seconds if args.load_seconds is not None else (30.0 if args.quick else 120.0)
    probe_rate = args.probe_rate if args.probe_rate is not None else (1.0 if args.quick else 2.0)
    if kills < 0 or load_seconds <= 0 or args.clients < 1 or args.run_rate <= 0 or probe_rate < 0:
        parser.error("kills must be >= 0; load seconds, clients and run rate > 0; probe rate >= 0")
    log_dir = args.log_dir or BASE_DIR / "var" / "drill" / datetime.now().strftime("%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)

    database_url = os.environ.get("DRILL_DATABASE_URL", "").strip() or DEFAULT_DATABASE_URL
    redis_url = os.environ.get("DRILL_REDIS_URL", "").strip() or DEFAULT_REDIS_URL
    pg_cluster = os.environ.get("DRILL_PG_CLUSTER", "").strip() or postgres_cluster_for(database_url)
    if not pg_cluster or "/" not in pg_cluster:
        print(f"error: no local PostgreSQL cluster serves {database_url}; set DRILL_PG_CLUSTER=VERSION/NAME "
              "(see pg_lsclusters)", file=sys.stderr)
        return 2

    started_postgres = redis_child = deployment = clients = load = None
    try:
        started_postgres = ensure_postgres(database_url)
        redis_child = ensure_redis(redis_url, log_dir)
        recreate_database(database_url)
        flush_redis(redis_url)
        os.environ.update({"DATABASE_URL": database_url, "REDIS_URL": redis_url, **DEPLOYMENT_ENV,
                           "DJANGO_SETTINGS_MODULE": "orchestrator_site.settings"})
        import django
        from django.core.management import call_command

        django.setup()
        logging.getLogger("orchestrator.transitions").setLevel(logging.WARNING)  # the processes log them
        call_command("migrate", verbosity=0)
        from rest_framework.authtoken.models import Token

        from billing.services import organization_create
        from core.models import Event
        from core.services import project_create

        organization, first, owner, _ = organization_create(name="drill", owner_username="drill", credits=10_000_000)
        projects = [first] + [project_create(organization=organization, name=f"drill-{n}") for n in range(1, PROJECTS)]
        token = Token.objects.create(user=owner).key
        log(f"database {database_url} (cluster {pg_cluster}), broker {redis_url}, logs {log_dir}")

        deployment = Deployment(database_url=database_url, redis_url=redis_url, clusters=2,
                                web_ports=[free_port(), free_port()], log_dir=log_dir, env=dict(DEPLOYMENT_ENV))
        deployment.start()
        log(f"2 qclusters (pids {[c.pid for c in deployment.workers]}) and 2 daphnes "
            f"(ports {deployment.web_ports}) started")
        start_id = Event.objects.order_by("-id").values_list("id", flat=True).first() or 0
        clients = connect_clients(deployment, token, projects, args.clients, start_id)
        log(f"{args.clients} WebSocket clients subscribed (half on each daphne)")

        actions: list[Row] = []
        load = Load(projects=projects, run_rate=args.run_rate, probe_rate=probe_rate).start()
        load_began = time.monotonic()
        time.sleep(min(5.0, load_seconds / 8))

        # (a) kill -9 busy workers, spread over the first part of the load.
        spacing = max(0.2, load_seconds * 0.3 / max(kills, 1))
        log(f"(a) killing {kills} busy workers with kill -9")
        killed, notes = kill_busy_workers(deployment, kills, spacing)
        actions.append(Row("kill -9 a worker executing a job", f"{sum(killed.values())}/{kills}",
                           "jobs interrupted: " + (", ".join(f"{t} {n}" for t, n in sorted(killed.items())) or "none")
                           + ("; " + "; ".join(notes) if notes else ""),
                           held=sum(killed.values()) == kills))  # fewer kills than asked: the drill fell short

        # (b) restart PostgreSQL.
        log(f"(b) restarting PostgreSQL {pg_cluster}")
        began = time.monotonic()
        restart_postgres(pg_cluster)
        wait_postgres(database_url)
        from django.db import connection

        connection.close()
        actions.append(Row(f"restart PostgreSQL ({pg_cluster})", "1",
                           f"answering again after {time.monotonic() - began:.1f}s"))
        time.sleep(3)

        # (c) SIGTERM a cluster and start it again.
        log("(c) SIGTERM to qcluster 1, then starting it again")
        code, stopped_in = deployment.restart_cluster(0)
        actions.append(Row("SIGTERM qcluster 1, start it again", "1",
                           f"stopped in {stopped_in:.1f}s (exit code {code}); started again",
                           held=code == 0))  # a clean stop: drained and exited 0 within its budget
        time.sleep(3)

        # (d) drop every client's socket at once.
        log(f"(d) resetting {args.clients} WebSocket sockets at once")
        began = time.monotonic()
        dropped = clients.drop_all()
        clients.wait_subscribed(timeout=120)
        actions.append(Row("reset the sockets of connected clients at once", str(dropped),
                           f"all resubscribed on the other daphne with `after` in {time.monotonic() - began:.1f}s"))

        remaining = load_seconds - (time.monotonic() - load_began)
        if remaining > 0:
            time.sleep(remaining)
        load.finish()
        load_elapsed = time.monotonic() - load_began
        actions.insert(0, Row("steady load", f"{load_elapsed:.0f}s",
                              f"{len(load.runs)} runs started, {len(load.probes)} probe jobs enqueued, "
                              f"{load.retried} submissions retried after a database error"))
        log(f"load stopped after {load_elapsed:.0f}s; waiting for quiescence")

        settled = wait_quiescent(load.runs, timeout=args.settle_seconds)
        end_id = with_database(lambda: Event.objects.order_by("-id").values_list("id", flat=True).first() or 0)
        targets = with_database(lambda: project_targets(clients, start_id, end_id))
        deadline = time.monotonic() + 60
        while not clients.caught_up(targets) and time.monotonic() < deadline:
            time.sleep(0.2)
        log("checking")
        checks = [check_runs(load.runs, settled)]
        checks += check_jobs(load.probes, load.error)
        checks.append(check_side_effects(load.runs))
        checks.append(check_invariants_command(python_env(DATABASE_URL=database_url, REDIS_URL=redis_url)))
        checks.append(check_clients(clients, start_id, end_id))
        checks.append(check_processes(deployment))
        print_table("What the drill did", actions)
        print_table("What held", checks)
        held = all(row.held for row in checks) and all(row.held for row in actions if row.held is not None)
        print(("every check held" if held else "SOME CHECKS DID NOT HOLD") + f"; process logs in {log_dir}", flush=True)
        return 0 if held else 1
    except (StackError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if load is not None and load.thread is not None and load.thread.is_alive():
            load.finish()
        if clients is not None:
            clients.stop()
        stack_stop(deployment, redis_child, started_postgres)


if __name__ == "__main__":
    sys.exit(main())
