"""The console in a real browser: Playwright driving Debian's Chromium (headless) against real
daphne and qcluster processes.

An operator logs in, opens the dashboard, starts a run from the admin and watches its status
change on the run page without a reload, force-fails another run through the runbook action
with a reason and sees the dashboard's failure count follow without a reload, and a screenshot
of the dashboard is kept under ``bench/out/``.

A second operator session, 1,280 pixels wide: a run page's Gantt chart draws the step tries as
they happen (a retried step's failed and succeeded tries as two bars) without a reload, the page
is no wider than the window, and "select all" over 520 runs of a filter runs a cancel as a
tracked bulk operation whose page shows it finish; screenshots of the run page, the run list,
the job list and the bulk operation are kept under ``bench/out/``.
"""

from __future__ import annotations

import os
import shutil
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import PBKDF2PasswordHasher
from django.core.management import call_command

from core.models import AuditRecord, BulkOperation, Organization, Project
from runs import services
from runs.models import Run
from tests.conftest import make_plan
from tests.processes import Cluster, Daphne, wait_for

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    sync_playwright = None

CHROMIUM = os.environ.get("ORCHESTRATOR_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
OUT = Path(settings.BASE_DIR) / "bench" / "out"
SCREENSHOT = OUT / "dashboard.png"
WIDTH = 1280
DASHBOARD = "/admin/dashboard/"
PASSWORD = "browser-pass-1"

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
    pytest.mark.skipif(sync_playwright is None, reason="Playwright is not installed (pip install -e '.[test]')"),
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium not found: `apt-get install chromium` "
                                                "(or set ORCHESTRATOR_CHROMIUM to its path)"),
]


def log_in(page, base: str) -> None:
    page.goto(f"{base}/admin/login/?next=/admin/")
    page.fill("#id_username", "operator")
    page.fill("#id_password", PASSWORD)
    page.click('input[type="submit"]')
    page.wait_for_url(f"{base}/admin/")


def seed_operator() -> Project:
    call_command("seed_demo", "--password", PASSWORD, stdout=StringIO())
    # The tests hash with a fast hasher that the console processes do not accept: store a hash they know.
    get_user_model().objects.filter(username="operator").update(
        password=PBKDF2PasswordHasher().encode(PASSWORD, "browsersalt", iterations=1000))
    return Project.objects.get(organization__name="Demo Org", name="default")


def page_width(page) -> int:
    return page.evaluate("document.documentElement.scrollWidth")


def choose_action(page, base: str, action: str, run: Run, reason: str) -> str:
    """Select ``run`` on the run changelist, pick ``action``, confirm with ``reason``; the messages shown."""
    page.goto(f"{base}/admin/runs/run/?q={run.pk}")
    page.check(f'input[name="_selected_action"][value="{run.pk}"]')
    page.select_option('select[name="action"]', action)
    page.click('button[name="index"]')
    page.wait_for_selector("#runbook-form")
    page.fill('textarea[name="reason"]', reason)
    page.click('#runbook-form input[type="submit"]')
    page.wait_for_selector("ul.messagelist")
    return page.inner_text("ul.messagelist")


def test_an_operator_watches_a_run_live_and_force_fails_another(tmp_path):
    call_command("seed_demo", "--password", PASSWORD, stdout=StringIO())
    # The tests hash with a fast hasher that the console processes do not accept: store a hash they know.
    get_user_model().objects.filter(username="operator").update(
        password=PBKDF2PasswordHasher().encode(PASSWORD, "browsersalt", iterations=1000))
    organization = Organization.objects.get(name="Demo Org")
    project = Project.objects.get(organization=organization, name="default")
    watched = services.run_create(project=project, name="browser: watched",
                                  plan=make_plan(steps=3, tool="sleep", args={"seconds": 1.0}))
    doomed = services.run_create(project=project, name="browser: doomed",
                                 plan=make_plan(steps=1, tool="sleep", args={"seconds": 120}))
    services.run_start(run_id=doomed.pk)

    with Daphne(tmp_path / "daphne.log") as daphne, Cluster(tmp_path / "qcluster.log", ORCHESTRATOR_Q_NAME="browser"):
        base = f"http://127.0.0.1:{daphne.port}"
        wait_for(lambda: Run.objects.get(pk=doomed.pk).status == Run.Status.RUNNING, timeout=60,
                 message="the doomed run running")
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            try:
                context = browser.new_context(viewport={"width": 1400, "height": 1000})
                page = context.new_page()
                page.goto(f"{base}/admin/login/?next=/admin/")
                page.fill("#id_username", "operator")
                page.fill("#id_password", PASSWORD)
                page.click('input[type="submit"]')
                page.wait_for_url(f"{base}/admin/")

                page.goto(f"{base}{DASHBOARD}")
                page.wait_for_selector("#dashboard-chart")
                assert page.locator("[data-metric]").count() >= 5

                # A second tab follows the watched run while the first starts it.
                watcher = context.new_page()
                watcher.goto(f"{base}/admin/runs/run/{watched.pk}/change/")
                badge = f'[data-live="run-status"][data-run="{watched.pk}"]'
                assert watcher.inner_text(badge).strip() == "created"
                watcher.wait_for_selector("#live-banner.live-live")
                watcher.evaluate("""(selector) => {
                    window.__sameDocument = true;
                    window.__seen = [];
                    const node = document.querySelector(selector);
                    new MutationObserver(() => window.__seen.push(node.textContent.trim()))
                        .observe(node, {childList: true, characterData: true, subtree: true});
                }""", badge)

                shown = choose_action(page, base, "start", watched, "start it from the browser")
                assert "done" in shown and "created → pending" in shown, shown

                watcher.wait_for_function("(s) => document.querySelector(s).textContent.trim() === 'completed'",
                                          arg=badge, timeout=90_000)
                assert watcher.evaluate("window.__sameDocument") is True  # no reload happened
                seen = watcher.evaluate("window.__seen")
                assert "running" in seen and seen[-1] == "completed", seen

                # A third tab keeps the dashboard open: its "runs failed" figure follows the force-fail live.
                board = context.new_page()
                board.goto(f"{base}{DASHBOARD}")
                board.wait_for_selector("#dashboard-chart")
                failed = '[data-metric="failures-runs-1h"]'
                failed_before = int(board.inner_text(failed).strip())
                board.evaluate("window.__sameDocument = true")
                shown = choose_action(page, base, "force_fail", doomed, "stuck on a 2-minute sleep")
                assert "done" in shown and "failed" in shown, shown
                board.wait_for_function("([s, n]) => parseInt(document.querySelector(s).textContent.trim()) === n",
                                        arg=[failed, failed_before + 1], timeout=60_000)
                assert board.evaluate("window.__sameDocument") is True  # updated in place, no reload

                page.goto(f"{base}{DASHBOARD}")
                page.wait_for_selector("#dashboard-chart")
                page.wait_for_timeout(1500)  # the first live refresh draws the chart
                SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(SCREENSHOT), full_page=True)
            finally:
                browser.close()
    # (The ORM is not called while Playwright's event loop runs in this thread.)
    assert SCREENSHOT.stat().st_size > 10_000
    watched.refresh_from_db()
    doomed.refresh_from_db()
    assert watched.status == Run.Status.COMPLETED
    assert doomed.status == Run.Status.FAILED and doomed.last_error_code == "force_failed"
    assert AuditRecord.objects.filter(target_type="run", target_id=str(doomed.pk),
                                      reason="stuck on a 2-minute sleep").exists()


FLAKY_PLAN = {"agents": [{"name": "browser", "tasks": [{"name": "steps", "steps": [
    {"name": "warm", "tool": "sleep", "args": {"seconds": 1.0}},
    {"name": "flaky", "tool": "fail", "args": {"mode": "retryable", "times": 1}},
    {"name": "cool", "tool": "sleep", "args": {"seconds": 1.0}},
]}]}]}
BULK_RUNS = 520  # beyond the admin's 500-object cap: "select all" becomes a bulk operation


def test_the_run_timeline_draws_tries_live_and_select_all_runs_a_bulk_operation(tmp_path):
    project = seed_operator()
    watched = services.run_create(project=project, name="browser: timeline", plan=FLAKY_PLAN)
    template = services.run_create(project=project, name="browser bulk 0", plan=make_plan())
    Run.objects.bulk_create([  # created is the default state: no transition is skipped
        Run(organization_id=template.organization_id, project=project, name=f"browser bulk {index}",
            plan=template.plan, credit_limit=template.credit_limit, status_changed_at=template.status_changed_at)
        for index in range(1, BULK_RUNS)], batch_size=500)
    bulk_ids = set(Run.objects.filter(name__startswith="browser bulk").values_list("pk", flat=True))
    assert len(bulk_ids) == BULK_RUNS
    OUT.mkdir(parents=True, exist_ok=True)
    shots = {name: OUT / f"{name}.png" for name in ("run_page", "run_list", "job_list", "bulk_operation")}
    widths = {}

    # The bulk operation's task is sent by the web process: it names the cluster's queue too.
    with Daphne(tmp_path / "daphne.log", ORCHESTRATOR_Q_NAME="browser") as daphne, \
            Cluster(tmp_path / "qcluster.log", ORCHESTRATOR_Q_NAME="browser"):
        base = f"http://127.0.0.1:{daphne.port}"
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
            try:
                context = browser.new_context(viewport={"width": WIDTH, "height": 900})
                page = context.new_page()
                log_in(page, base)

                # The run page, before the run starts: the summary on top, an empty chart.
                watcher = context.new_page()
                watcher.goto(f"{base}/admin/runs/run/{watched.pk}/change/")
                watcher.wait_for_selector("#run-gantt .run-gantt-empty")
                assert "no step has been tried yet" in watcher.inner_text("#run-gantt")
                assert watcher.inner_text("#run-summary .run-summary-status").strip() == "created"
                watcher.wait_for_selector("#live-banner.live-live")
                watcher.evaluate("window.__sameDocument = true")

                # Started from the runbook button at the top of its page (in the other tab).
                page.goto(f"{base}/admin/runs/run/{watched.pk}/change/")
                page.click('#run-summary a[data-runbook="start"]')
                page.wait_for_selector("#runbook-form")
                page.fill('textarea[name="reason"]', "start it for the timeline")
                page.click('#runbook-form input[type="submit"]')
                page.wait_for_selector("ul.messagelist")
                assert "created → pending" in page.inner_text("ul.messagelist")
                # Bars appear as the steps are tried, then the retried step's second try, then the rest.
                bars = "#run-gantt rect.gantt-bar"
                watcher.wait_for_selector(f"{bars}[data-status]", timeout=60_000)
                watcher.wait_for_selector(f'{bars}[data-status="failed"]', timeout=60_000)
                watcher.wait_for_function(
                    "(s) => document.querySelectorAll(s + '[data-status=\"succeeded\"]').length === 3",
                    arg=bars, timeout=90_000)
                watcher.wait_for_function(
                    "() => document.querySelector('#run-summary .run-summary-status').textContent.trim()"
                    " === 'completed'", timeout=60_000)
                watcher.wait_for_timeout(1500)  # the last throttled re-fetch
                assert watcher.evaluate("window.__sameDocument") is True  # drawn live, no reload
                tries = watcher.evaluate("""(s) => Array.from(document.querySelectorAll(s)).map(bar => ({
                    step: bar.getAttribute('data-step'), status: bar.getAttribute('data-status'),
                    title: bar.querySelector('title').textContent}))""", bars)
                assert len(tries) == 4, tries
                flaky = [bar for bar in tries if bar["title"].startswith("step flaky")]
                assert [bar["status"] for bar in flaky] == ["failed", "succeeded"], flaky
                assert "try 1: failed" in flaky[0]["title"] and "error drill_retryable" in flaky[0]["title"]
                assert len({bar["step"] for bar in flaky}) == 1  # the same lane: one step, two tries
                assert "attempt 1 · browser → steps" in watcher.inner_text("#run-gantt")
                charged = watcher.inner_text('#run-summary [data-credits="charged"]').strip()
                assert charged == "4", charged  # the summary's credits followed the run too
                watcher.reload()  # the whole page as it now is (its buttons, its sections)
                watcher.wait_for_selector("#run-gantt svg")
                watcher.wait_for_timeout(500)
                widths["run_page"] = page_width(watcher)
                watcher.screenshot(path=str(shots["run_page"]), full_page=True)
                # Every section opened, no table reaches past the window.
                watcher.evaluate("document.querySelectorAll('details').forEach(d => { d.open = true; })")
                overflowing = watcher.evaluate("""() => Array.from(document.querySelectorAll('table'))
                    .filter(t => t.getBoundingClientRect().right > document.documentElement.clientWidth + 1)
                    .map(t => t.className || t.parentElement.className)""")
                assert overflowing == [], overflowing
                widths["run_page_opened"] = page_width(watcher)

                page.goto(f"{base}/admin/runs/run/")
                page.wait_for_selector("#result_list")
                widths["run_list"] = page_width(page)
                page.screenshot(path=str(shots["run_list"]))  # the first screenful of a page of 100 rows
                page.goto(f"{base}/admin/jobs/job/")
                page.wait_for_selector("#result_list")
                widths["job_list"] = page_width(page)
                page.screenshot(path=str(shots["job_list"]))

                # "Select all" beyond the page cap: a tracked bulk operation with a live progress page.
                page.goto(f"{base}/admin/runs/run/?status__exact=created&q=browser+bulk")
                page.check("#action-toggle")
                page.click(".actions .question a")
                page.select_option('select[name="action"]', "cancel")
                page.click('button[name="index"]')
                page.wait_for_selector("#runbook-bulk")
                assert page.get_attribute("[data-bulk-total]", "data-bulk-total") == str(BULK_RUNS)
                page.fill('textarea[name="reason"]', "browser: cancel the whole filter")
                page.click('#runbook-form input[type="submit"]')
                page.wait_for_selector("#bulk-progress")
                page.wait_for_function("() => document.getElementById('bulk-progress').dataset.status === 'finished'",
                                       timeout=120_000)
                assert page.inner_text('#bulk-progress [data-field="done"]').strip() == str(BULK_RUNS)
                page.reload()  # its fields as the finished operation has them
                page.wait_for_selector('#bulk-progress[data-status="finished"]')
                widths["bulk_operation"] = page_width(page)
                page.screenshot(path=str(shots["bulk_operation"]), full_page=True)
            finally:
                browser.close()
    # (The ORM is not called while Playwright's event loop runs in this thread.)
    for name, shot in shots.items():
        assert shot.stat().st_size > 10_000, name
    assert max(widths["run_page"], widths["run_page_opened"], widths["bulk_operation"]) <= WIDTH, widths
    watched.refresh_from_db()
    assert watched.status == Run.Status.COMPLETED
    operation = BulkOperation.objects.get()
    assert (operation.runbook, operation.total, operation.done, operation.status) == (
        "runs.run.cancel", BULK_RUNS, BULK_RUNS, "finished")
    assert set(Run.objects.filter(pk__in=bulk_ids).values_list("status", flat=True)) == {"cancelled"}
    assert AuditRecord.objects.filter(action="run_cancel", target_id__in=[str(pk) for pk in bulk_ids]).count() == \
        BULK_RUNS
