"""The console in a real browser: Playwright driving Debian's Chromium (headless) against real
daphne and qcluster processes.

An operator logs in, opens the dashboard, starts a run from the admin and watches its status
change on the run page without a reload, force-fails another run through the runbook action
with a reason and sees the dashboard's failure count follow without a reload, and a screenshot
of the dashboard is kept under ``bench/out/``.
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

from core.models import AuditRecord, Organization, Project
from runs import services
from runs.models import Run
from tests.conftest import make_plan
from tests.processes import Cluster, Daphne, wait_for

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - the test extra installs it
    sync_playwright = None

CHROMIUM = os.environ.get("ORCHESTRATOR_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = Path(settings.BASE_DIR) / "bench" / "out" / "dashboard.png"
DASHBOARD = "/admin/dashboard/"
PASSWORD = "browser-pass-1"

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
    pytest.mark.skipif(sync_playwright is None, reason="Playwright is not installed (pip install -e '.[test]')"),
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium not found: `apt-get install chromium` "
                                                "(or set ORCHESTRATOR_CHROMIUM to its path)"),
]


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
