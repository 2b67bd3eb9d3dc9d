"""``deploy/grafana/orchestrator.json``: an importable dashboard whose queries read exposed metrics."""

from __future__ import annotations

import json

import pytest
from django.test import Client

from tests.observability.promql import exposed_names, metric_names
from tests.observability.test_alerts import _activity
from tests.observability.test_metrics import TOKEN, metrics_token  # noqa: F401  (fixture)
from tests.processes import BASE_DIR

DASHBOARD = BASE_DIR / "deploy" / "grafana" / "orchestrator.json"


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries() -> list[tuple[str, str]]:
    found = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"]))
    return found


def test_the_datasource_is_an_input_every_panel_uses():
    data = dashboard()
    assert [item["name"] for item in data["__inputs"]] == ["DS_PROMETHEUS"]
    assert data["__inputs"][0]["pluginId"] == "prometheus"
    ids = [panel["id"] for panel in data["panels"]]
    assert len(ids) == len(set(ids))
    for panel in data["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]


def test_the_dashboard_covers_queue_throughput_runs_credits_workers_and_relay():
    read = set().union(*(metric_names(expr) for _, expr in queries()))
    for name in ("orchestrator_queue_depth", "orchestrator_queue_oldest_wait_seconds",
                 "orchestrator_job_wait_seconds_bucket", "orchestrator_job_completions_total",
                 "orchestrator_job_failures_total", "orchestrator_runs", "orchestrator_credits_reserved",
                 "orchestrator_workers_alive", "orchestrator_relay_lag_events"):
        assert name in read, name


@pytest.mark.django_db(transaction=True)
def test_every_query_reads_only_exposed_metrics(org_factory, define_job):
    _activity(org_factory, define_job)
    exposed = exposed_names(Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").content.decode())
    for title, expr in queries():
        names = metric_names(expr)
        assert names, (title, expr)
        assert names <= exposed, (title, names - exposed)
