"""``deploy/prometheus/alerts.yml``: promtool accepts the rules and their unit tests pass, every
metric a rule reads is one ``/metrics`` exposes, and the runbooks they point to exist."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from datetime import timedelta

import pytest
import yaml
from django.test import Client
from django.utils import timezone

from jobs.models import WorkerHeartbeat
from jobs.registry import RetryPolicy
from jobs.services import job_enqueue
from runs import services as run_services
from runs.services.escalations import escalation_open
from runs.models import EscalationTicket, Run
from tests.conftest import make_plan
from tests.drive import drain_jobs
from tests.observability.promql import exposed_names, metric_names
from tests.observability.test_metrics import TOKEN, metrics_token, scrape, value  # noqa: F401  (fixture)
from tests.processes import BASE_DIR, database_env

RULES = BASE_DIR / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = BASE_DIR / "deploy" / "prometheus" / "alerts_test.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian package "
                                                              "`prometheus`: apt-get install prometheus)")


def alert_rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


@needs_promtool
def test_promtool_accepts_the_rules():
    result = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


@needs_promtool
def test_the_rule_unit_tests_pass():
    result = subprocess.run([PROMTOOL, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_tested_firing_and_not_firing():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing, quiet = set(), set()
    for test in tests:
        for case in test.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {rule["alert"] for rule in alert_rules()}
    assert names - firing == set(), "alerts never shown firing"
    assert names - quiet == set(), "alerts never shown quiet"


def test_every_alert_has_a_severity_summary_description_and_runbook():
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        for key in ("summary", "description", "runbook"):
            assert rule["annotations"].get(key, "").strip(), (rule["alert"], key)
        runbook = rule["annotations"]["runbook"]
        assert "/admin/" in runbook or "manage.py " in runbook, rule["alert"]


def test_the_tokenizer_finds_metric_names_only():
    expr = ('sum by (type, reason) (rate(orchestrator_job_failures_total{reason!~"a|b"}[15m] offset 1h)) '
            '/ on (type) group_left sum without (le) (orchestrator_x) > 0.2 and '
            'histogram_quantile(0.95, sum by (le) (rate(orchestrator_h_bucket[$__rate_interval]))) > 1e3')
    assert metric_names(expr) == {"orchestrator_job_failures_total", "orchestrator_x", "orchestrator_h_bucket"}


@pytest.mark.django_db(transaction=True)
def test_every_metric_a_rule_reads_is_exposed(org_factory, define_job):
    """Scrape after some activity of every kind, and check each name the rules read."""
    _activity(org_factory, define_job)
    response = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    exposed = exposed_names(response.content.decode())
    read = set()
    for rule in alert_rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        read |= names
    assert read - exposed == set()


@pytest.mark.django_db(transaction=True)
def test_run_escalation_and_invariant_metrics(org_factory, define_job):
    organization, project, owner = org_factory(credits=10_000)
    _activity(org_factory, define_job, project=project, owner=owner)
    samples = scrape()
    assert value(samples, "orchestrator_runs_finished_total", state="failed", reason="tool_error") == 1
    assert value(samples, "orchestrator_runs_finished_total", state="cancelled", reason="") == 1
    assert value(samples, "orchestrator_runs_stuck") == 1
    assert value(samples, "orchestrator_escalations_open", trigger="manual") == 1
    assert value(samples, "orchestrator_escalations_open", trigger="error_burst") == 0
    assert 7200 <= value(samples, "orchestrator_escalation_oldest_open_seconds") < 7300
    assert 60 <= value(samples, "orchestrator_queue_oldest_wait_seconds") < 3600
    # The invariants were checked by another process: this one reports its outcome.
    for check in ("credits", "ledger", "hierarchy", "state"):
        assert value(samples, "orchestrator_invariant_violations", check=check) == 0
        checked = value(samples, "orchestrator_invariants_last_check_timestamp_seconds", check=check)
        assert abs(checked - timezone.now().timestamp()) < 300
    # An acknowledged escalation is no longer open.
    ticket = EscalationTicket.objects.get()
    from runs.services.escalations import escalation_acknowledge

    escalation_acknowledge(ticket_id=ticket.pk, actor=owner, reason="looking")
    samples = scrape()
    assert value(samples, "orchestrator_escalations_open", trigger="manual") == 0
    assert value(samples, "orchestrator_escalation_oldest_open_seconds") == 0


@pytest.mark.django_db(transaction=True)
def test_a_violation_found_by_the_command_shows_until_a_clean_run(org_factory):
    organization, project, owner = org_factory(credits=500)
    run = run_services.run_create(project=project, name="v", plan=make_plan(), actor=owner)
    run_services.run_start(run_id=run.pk, actor=owner)
    # Break credit conservation behind the services' back: the run claims more charged than reserved.
    Run.objects.filter(pk=run.pk).update(credits_refunded=10_000)
    assert _check_invariants("--only", "credits").returncode == 1
    samples = scrape()
    assert value(samples, "orchestrator_invariant_violations", check="credits") >= 1
    assert ("check", "ledger") not in dict(samples.get("orchestrator_invariant_violations", {}))
    Run.objects.filter(pk=run.pk).update(credits_refunded=0)
    assert _check_invariants("--only", "credits").returncode == 0
    assert value(scrape(), "orchestrator_invariant_violations", check="credits") == 0


@pytest.mark.django_db
def test_every_admin_page_a_runbook_names_opens(django_user_model):
    admin_user = django_user_model.objects.create_superuser(username="rb-admin", password="pw")
    client = Client()
    client.force_login(admin_user)
    paths = set()
    for rule in alert_rules():
        runbook = re.sub(r"\{\{[^}]*\}\}", "x", rule["annotations"]["runbook"])
        paths.update(re.findall(r"/admin/[^\s;)]*", runbook))
    assert len(paths) >= 8
    for path in sorted(paths):
        response = client.get(path)
        # An unknown filter parameter redirects to ?e=1; a missing page is 404.
        assert response.status_code == 200, (path, response.status_code)


def _check_invariants(*args: str) -> subprocess.CompletedProcess:
    env = {**database_env(), "ORCHESTRATOR_TRANSITION_LOG_LEVEL": "WARNING"}
    return subprocess.run([sys.executable, "manage.py", "check_invariants", *args], cwd=BASE_DIR, env=env,
                          capture_output=True, text=True, timeout=120)


def _activity(org_factory, define_job, *, project=None, owner=None) -> None:
    """A failed job, a failed, a cancelled and a stuck run, an open escalation, a waiting job,
    workers alive and stale, and a check_invariants run in another process."""
    if project is None:
        _, project, owner = org_factory(credits=10_000)
    define_job(type="obs_alert_flaky", run=lambda ctx, payload: (_ for _ in ()).throw(ConnectionError("down")),
               retry=RetryPolicy(max_attempts=1, base_delay_ms=1, jitter=False), lane=lambda p, pid: "")
    job_enqueue(job_type="obs_alert_flaky", project=project, payload={})
    drain_jobs()
    failed = run_services.run_create(project=project, name="fails", plan=make_plan(), actor=owner, )
    run_services.run_start(run_id=failed.pk, actor=owner)
    run_services.run_fail(run_id=failed.pk, code="tool_error", message="broken")
    cancelled = run_services.run_create(project=project, name="cancelled", plan=make_plan(), actor=owner)
    run_services.run_cancel(run_id=cancelled.pk, actor=owner, reason="not needed")
    stuck = run_services.run_create(project=project, name="stuck", plan=make_plan(), actor=owner)
    run_services.run_start(run_id=stuck.pk, actor=owner)
    # Pending for longer than its timeout: the clock moved on.
    Run.objects.filter(pk=stuck.pk).update(status_changed_at=timezone.now() - timedelta(days=3))
    ticket, _ = escalation_open(run=Run.objects.get(pk=stuck.pk), trigger="manual", detail="look at it")
    EscalationTicket.objects.filter(pk=ticket.pk).update(created_at=timezone.now() - timedelta(hours=2))
    waiting = job_enqueue(job_type="noop", project=project, payload={}).job
    waiting.__class__.objects.filter(pk=waiting.pk).update(queued_at=timezone.now() - timedelta(minutes=2))
    now = timezone.now()
    WorkerHeartbeat.objects.create(worker="host:1", cluster="c", started_at=now, last_seen=now)
    WorkerHeartbeat.objects.create(worker="host:2", cluster="c", started_at=now, last_seen=now - timedelta(hours=1))
    result = _check_invariants()
    assert result.returncode in (0, 1), result.stderr
