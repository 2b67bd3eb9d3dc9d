"""The living demo: a small, steady stream of runs so the console is alive when it first opens.

``demo_tick`` is one beat of the stream (``manage.py demo_stream`` calls it every few seconds,
``run_console --demo`` starts that command). Each beat keeps a mix an operator can practise on:

- most runs complete (a research DAG of echo and sleep steps, sometimes with a step that fails
  once and succeeds on its retry);
- some fail for good with a retryable error (one attempt allowed), for the retry and refund
  runbooks;
- one run waits at an approval gate (``awaiting_approval:release``), for the approve runbook;
- one run is stuck: it reached ``running`` but its dispatch message was lost, so no worker
  took it and it sends no heartbeat — the state the orphan re-dispatcher and the heartbeat
  reaper repair on their own, and that ``recover_stuck_runs`` repairs when an operator does.
  It only stays stuck where automatic recovery is off (``ORCHESTRATOR_RUN_AUTO_RECOVER=0``,
  which ``run_console --demo`` sets) so the recovery runbook has something to do.

Everything goes through the run services; the stream tops the organization's credits up when
they run low and never has more than ``max_active`` ordinary runs in flight.

``demo_showcase`` (each beat of ``demo_stream`` after ``demo_tick``) keeps the operator features on
show, each once at a time:

- a re-plan that heals: a run whose flaky step fails all its tries, is re-planned (its new agent
  holds a budget of its own) and completes on the re-planned try;
- a paused queue: ``seed_demo`` pauses the project ``nightly`` with a reason (the dashboard lists
  it); the showcase keeps one run waiting in it ("why is this waiting?" says paused, by whom, why);
- a bulk retry: once two or more failing runs can still be retried, a tracked bulk operation
  retries every run the run list's filter ``status=failed`` + ``q=ingest`` matches (its page shows
  the progress).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass, field

from datetime import timedelta

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from billing.selectors import account_balance
from billing.services import account_topup
from core.bulk import bulk_operation_launch, bulk_operation_start
from core.models import BulkOperation, Organization, Project
from core.runbooks import runbook_get
from jobs.models import QueuePause
from runs import services
from runs.models import IN_FLIGHT_RUN_STATES, Run

DEMO_ORGANIZATION = "Demo Org"
WEDGED_NAME = "demo: lost dispatch"
GATED_NAME = "demo: release"
TOPUP_BELOW = 2_000
TOPUP_AMOUNT = 100_000
ACTIVE = [Run.Status.CREATED, *IN_FLIGHT_RUN_STATES]
FAILING_NAME = "demo: ingest (fails)"
HEALS_NAME = "demo: re-plan heals"
PAUSED_PROJECT = "nightly"
PAUSED_REASON = "upstream maintenance window (demo): its runs wait until an operator resumes the queue"
WAITING_NAME = "demo: nightly report (queue paused)"
BULK_QUERY = "status__exact=failed&q=ingest"
BULK_REASON = "demo: the upstream is back, retry the failed ingest runs"
SHOWCASE_EVERY = timedelta(minutes=3)


def plan_research(*, flaky: bool) -> dict:
    agents = [{"name": "research", "parallelism_mode": "dag", "tasks": [
        {"name": "fetch", "steps": [
            {"name": "hello", "tool": "echo", "args": {"text": "hi"}},
            {"name": "wait", "tool": "sleep", "args": {"seconds": 0.5}},
        ]},
        {"name": "report", "depends_on": ["fetch"], "steps": [
            {"name": "summary", "tool": "echo", "args": {"text": "done"}},
        ]},
    ]}]
    if flaky:
        agents.append({"name": "drill", "failure_mode": "continue", "tasks": [
            {"name": "flaky", "steps": [{"name": "flaky", "tool": "fail", "args": {"mode": "retryable", "times": 1}}]},
        ]})
    return {"max_agents": 2, "agents": agents}


PLAN_FAILING = {"agents": [{"name": "ingest", "tasks": [
    {"name": "load", "steps": [
        {"name": "connect", "tool": "echo", "args": {"text": "connecting"}},
        {"name": "upstream", "tool": "fail", "args": {"mode": "retryable", "times": 99}},
    ]},
]}]}

# Its step fails every try of its first round: the task and agent fail, the planner re-plans the
# failed work as a new agent (with a credit reservation of its own), and the re-planned try heals.
PLAN_HEALS = {"agents": [{"name": "solo", "tasks": [
    {"name": "flaky", "steps": [{"name": "flaky", "tool": "fail", "args": {"mode": "retryable", "times": 3}}]},
]}]}

PLAN_NIGHTLY = {"agents": [{"name": "nightly", "tasks": [
    {"name": "report", "steps": [{"name": "report", "tool": "echo", "args": {"text": "nightly report"}}]},
]}]}

PLAN_GATED = {"agents": [{"name": "release", "tasks": [
    {"name": "ship", "steps": [
        {"name": "build", "tool": "echo", "args": {"text": "built"}},
        {"name": "approve", "kind": "approval", "gate": "release",
         "args": {"question": "ship the demo release?"}},
        {"name": "announce", "tool": "echo", "args": {"text": "shipped"}},
    ]},
]}]}

PLAN_WEDGED = {"agents": [{"name": "worker", "tasks": [
    {"name": "work", "steps": [{"name": "work", "tool": "echo", "args": {"text": "never dispatched"}}]},
]}]}


@dataclass
class Beat:
    """What one beat of the stream did, one line per thing."""

    did: list[str] = field(default_factory=list)


@contextmanager
def _dispatch_lost():
    """Runs started inside are not handed to a worker: their dispatch message is lost."""
    saved = list(services.RUN_DISPATCHERS)
    services.RUN_DISPATCHERS.clear()
    try:
        yield
    finally:
        services.RUN_DISPATCHERS[:] = saved


def demo_projects(organization: Organization) -> list[Project]:
    """The projects the stream starts its runs in: those whose queue is not paused."""
    paused = QueuePause.objects.filter(project__isnull=False).values("project_id")
    return list(Project.objects.filter(organization=organization).exclude(pk__in=paused).order_by("pk"))


def _start(project: Project, name: str, plan: dict, *, actor, max_attempts: int = 3) -> Run:
    with transaction.atomic():
        run = services.run_create(project=project, name=name, plan=plan, max_attempts=max_attempts, actor=actor,
                                  reason="demo stream")
        return services.run_start(run_id=run.pk, actor=actor, reason="demo stream")


def demo_tick(*, organization: Organization, actor=None, rng: random.Random | None = None,
              max_active: int = 4) -> Beat:
    """One beat: top up, keep one gated and one stuck run, start one more run if there is room."""
    rng = rng or random.Random()
    beat = Beat()
    projects = demo_projects(organization)
    if not projects:
        beat.did.append("no project: run seed_demo first")
        return beat
    runs = Run.objects.filter(organization=organization)
    if account_balance(organization_id=organization.pk)["available"] < TOPUP_BELOW:
        account_topup(organization_id=organization.pk, amount=TOPUP_AMOUNT, reason="demo top-up", actor=actor)
        beat.did.append(f"topped up {TOPUP_AMOUNT} credits")

    gated_open = runs.filter(name=GATED_NAME, status__in=ACTIVE + [Run.Status.PAUSED]).exists()
    if not gated_open:
        run = _start(projects[0], GATED_NAME, PLAN_GATED, actor=actor)
        beat.did.append(f"run {run.pk}: will wait at the approval gate 'release'")

    wedged_open = runs.filter(name=WEDGED_NAME, status__in=ACTIVE).exists()
    if not wedged_open:
        with _dispatch_lost():
            run = _start(projects[-1], WEDGED_NAME, PLAN_WEDGED, actor=actor)
            services.run_mark_running(run_id=run.pk)
        beat.did.append(f"run {run.pk}: running with a lost dispatch (stuck once its heartbeat goes silent)")

    in_flight = runs.filter(status__in=IN_FLIGHT_RUN_STATES).exclude(name__in=[WEDGED_NAME, GATED_NAME]).count()
    if in_flight < max_active:
        roll = rng.random()
        project = rng.choice(projects)
        if roll < 0.12:
            run = _start(project, FAILING_NAME, PLAN_FAILING, actor=actor, max_attempts=2)
            beat.did.append(f"run {run.pk}: will fail with a retryable error")
        else:
            flaky = roll < 0.35
            run = _start(project, "demo: research" + (" (flaky step)" if flaky else ""),
                         plan_research(flaky=flaky), actor=actor)
            beat.did.append(f"run {run.pk}: will complete" + (" after one retried step" if flaky else ""))
    return beat


def _recent(runs, name: str, *, now) -> bool:
    """A run of that name is in flight, or ended less than ``SHOWCASE_EVERY`` ago."""
    return (runs.filter(name=name, status__in=ACTIVE).exists()
            or runs.filter(name=name, status_changed_at__gte=now - SHOWCASE_EVERY).exists())


def demo_showcase(*, organization: Organization, actor=None) -> Beat:
    """Keep a healing re-plan, a run waiting in a paused queue and a bulk retry on show (see the
    module docstring); each beat does only what is missing."""
    beat = Beat()
    now = timezone.now()
    projects = demo_projects(organization)
    runs = Run.objects.filter(organization=organization)
    if projects and not _recent(runs, HEALS_NAME, now=now):
        run = _start(projects[0], HEALS_NAME, PLAN_HEALS, actor=actor)
        beat.did.append(f"run {run.pk}: its flaky step will fail, be re-planned and heal")

    paused = (QueuePause.objects.filter(project__organization=organization, project__name=PAUSED_PROJECT)
              .select_related("project").first())
    if paused is not None and not runs.filter(name=WAITING_NAME, status__in=ACTIVE).exists():
        run = _start(paused.project, WAITING_NAME, PLAN_NIGHTLY, actor=actor)
        beat.did.append(f"run {run.pk}: waits in the paused queue of project {PAUSED_PROJECT!r}")

    retryable = runs.filter(name=FAILING_NAME, status=Run.Status.FAILED, attempt_number__lt=F("max_attempts"))
    bulk_busy = BulkOperation.objects.filter(runbook="runs.run.retry", query=BULK_QUERY).filter(
        status=BulkOperation.Status.RUNNING).exists()
    recent_bulk = BulkOperation.objects.filter(runbook="runs.run.retry", query=BULK_QUERY,
                                               started_at__gte=now - SHOWCASE_EVERY).exists()
    if retryable.count() >= 2 and not bulk_busy and not recent_bulk:
        with transaction.atomic():
            operation = bulk_operation_start(runbook=runbook_get(Run, "retry"), query=BULK_QUERY, actor=actor,
                                             reason=BULK_REASON)
            bulk_operation_launch(operation)
        beat.did.append(f"bulk operation {operation.pk}: retrying the {operation.total} failed runs of the filter "
                        f"{BULK_QUERY}")
    return beat
