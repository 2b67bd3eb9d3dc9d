"""The dashboard at scale: bounded counts of live and stuck runs ("1000+"), and the stuck rule cut
into disjoint index ranges (``run_stuck_parts``) that mean exactly what ``run_stuck_q`` means."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from console.dashboard import dashboard_snapshot
from core.admin_scale import counts_bounded
from runs.models import Run
from runs.selectors import RUN_STUCK_PART_ORDERINGS, run_stuck_parts, run_stuck_q
from tests.console.conftest import build_run

pytestmark = pytest.mark.django_db


def test_the_stuck_parts_split_the_stuck_rule_without_overlap(project, job_in, settings):
    settings.ORCHESTRATOR_RUN_HEARTBEAT_TIMEOUT_S = 60
    settings.ORCHESTRATOR_RUN_RUNNING_TIMEOUT_S = 3600
    now = timezone.now()
    old, recent = now - timedelta(hours=5), now - timedelta(seconds=5)
    template = build_run(project, "running", name="template")
    queued_job = job_in("queued")
    # Every combination of status, start, heartbeat and status time that the rule reads.
    combos = itertools.product(["running", "pending", "paused", "completed"], [None, old, recent],
                               [None, old, recent], [None, old, recent])
    ids = []
    for status, started, heartbeat, changed in combos:
        run = Run.objects.create(organization_id=template.organization_id, project=project, name="combo",
                                 plan=template.plan, credit_limit=template.credit_limit, status=status,
                                 started_at=started, last_heartbeat=heartbeat, status_changed_at=changed)
        ids.append(run.pk)
    # A silent running run whose work waits in the queue: stuck only if it started long ago.
    for started in (old, recent):
        waiting = Run.objects.create(organization_id=template.organization_id, project=project, name="queued",
                                     plan=template.plan, credit_limit=template.credit_limit, status="running",
                                     started_at=started, last_heartbeat=old, status_changed_at=old)
        ids.append(waiting.pk)
    type(queued_job).objects.filter(pk=queued_job.pk).update(run_id=waiting.pk)
    everything = Run.objects.filter(pk__in=ids)
    stuck = set(everything.filter(run_stuck_q(now=now)).values_list("pk", flat=True))
    parts = [set(everything.filter(part).values_list("pk", flat=True)) for part in run_stuck_parts(now=now)]
    assert len(parts) == len(RUN_STUCK_PART_ORDERINGS)
    assert set().union(*parts) == stuck
    assert sum(len(part) for part in parts) == len(stuck)  # no run in two parts
    assert 10 < len(stuck) < len(ids)  # the scene has both kinds


def test_counts_stop_at_the_limit_in_one_query(project, django_assert_num_queries):
    for _ in range(4):
        build_run(project, "pending")
    build_run(project, "paused")
    with django_assert_num_queries(1):
        counted = counts_bounded({"pending": Run.objects.filter(status="pending"),
                                  "paused": Run.objects.filter(status="paused").order_by("id"),
                                  "none": Run.objects.filter(status="resuming")}, 2)
    assert counted == {"pending": 3, "paused": 1, "none": 0}  # 3: "more than 2"


def test_the_dashboard_shows_bounded_figures_with_a_plus(project, settings, make_staff, login):
    settings.ORCHESTRATOR_DASHBOARD_COUNT_LIMIT = 2
    settings.ORCHESTRATOR_RUN_PENDING_TIMEOUT_S = 0  # every pending run is stuck
    for _ in range(3):
        build_run(project, "pending")
    build_run(project, "paused")
    snapshot = dashboard_snapshot()
    metrics = snapshot["metrics"]
    assert (metrics["runs-pending"], metrics["runs-paused"], metrics["runs-stuck"]) == (2, 1, 2)
    assert set(snapshot["bounded"]) == {"runs-pending", "runs-live", "runs-stuck"}
    assert len(snapshot["runs"]["stuck"]) == 3  # the list is not bounded by the count
    client = login(make_staff("dash-viewer"))
    page = client.get(reverse("dashboard:index")).content.decode()
    assert 'data-metric="runs-pending" data-value="2+">2+</span>' in page
    assert 'data-metric="runs-paused" data-value="1">1</span>' in page
    settings.ORCHESTRATOR_DASHBOARD_COUNT_LIMIT = 1000
    snapshot = dashboard_snapshot()
    assert snapshot["bounded"] == [] and snapshot["metrics"]["runs-stuck"] == 3
