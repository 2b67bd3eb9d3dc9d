"""The operations dashboard in the admin: ``/admin/dashboard/`` and its JSON ``data/``.

The page is rendered with a first snapshot and kept current by ``orchestrator/dashboard.js``:
it re-reads ``data/`` when events arrive over ``/ws/events/`` (at most about once a second) and
every ten seconds. Both are for active staff only (the admin's own rule): the page sends others
to the admin login, the JSON answers ``401 not_authenticated`` or ``403 permission_denied``.
The JSON never answers 500: a failed read is ``503 dashboard_unavailable``.
"""

from __future__ import annotations

import logging

from django.contrib import admin
from django.http import JsonResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.views.decorators.cache import never_cache

from console.dashboard import dashboard_snapshot

logger = logging.getLogger("orchestrator.console")

app_name = "dashboard"

REFRESH_INTERVAL_MS = 10_000
MIN_REFETCH_INTERVAL_MS = 1_000

# The headline figures, by group: (metric, label, when it is an alert: "nonzero", "zero" or "").
# Each tile is ``<a data-metric="<metric>">`` to the changelist of ``snapshot["links"][metric]``.
TILE_GROUPS = [
    ("Queue", [("jobs-waiting", "jobs waiting", ""), ("jobs-delayed", "of which delayed", ""),
               ("jobs-executing", "jobs executing", ""), ("jobs-concurrency", "concurrency slots", "")]),
    ("Runs", [("runs-running", "running", ""), ("runs-stuck", "stuck", "nonzero"), ("runs-pending", "pending", ""),
              ("runs-paused", "paused", ""), ("runs-live", "live in all", "")]),
    ("Last hour", [("throughput-jobs-1h", "jobs completed", ""), ("throughput-runs-1h", "runs completed", ""),
                   ("failures-jobs-1h", "jobs failed", "nonzero"), ("failures-runs-1h", "runs failed", "nonzero")]),
    ("Credits and escalations", [("credits-reserved", "credits reserved", ""),
                                 ("credits-organizations", "organizations holding credits", ""),
                                 ("escalations-open", "open escalations", "nonzero"),
                                 ("escalations-acknowledged", "acknowledged escalations", "")]),
    ("Workers", [("workers-alive", "workers alive", "zero"), ("workers-stale", "workers stale", "")]),
]


def _tiles(snapshot: dict) -> list[dict]:
    metrics, links = snapshot["metrics"], snapshot["links"]
    bounded = set(snapshot.get("bounded", ()))
    groups = []
    for title, tiles in TILE_GROUPS:
        rows = []
        for metric, label, alert in tiles:
            value = metrics.get(metric, 0)
            rows.append({"metric": metric, "label": label, "value": value, "url": links.get(metric), "alert": alert,
                         "shown": f"{value}+" if metric in bounded else value,
                         "alerting": (alert == "nonzero" and value != 0) or (alert == "zero" and value == 0)})
        groups.append({"title": title, "tiles": rows})
    return groups


def _error(status: int, code: str, detail: str) -> JsonResponse:
    return JsonResponse({"code": code, "detail": detail}, status=status)


def dashboard_page(request):
    """The dashboard, with its first snapshot rendered in the page."""
    snapshot = dashboard_snapshot()
    context = {
        **admin.site.each_context(request),
        "title": "Operations dashboard",
        "snapshot": snapshot,
        "tile_groups": _tiles(snapshot),
        "stuck_url": snapshot["links"]["runs-stuck"],
        "escalations_url": snapshot["links"]["escalations-open"],
        "data_url": reverse("dashboard:data"),
        "refresh_interval_ms": REFRESH_INTERVAL_MS,
        "min_refetch_interval_ms": MIN_REFETCH_INTERVAL_MS,
    }
    request.current_app = admin.site.name
    return TemplateResponse(request, "admin/dashboard.html", context)


@never_cache
def dashboard_data(request):
    """The same snapshot as JSON, for staff; a clear JSON error for anyone else."""
    user = request.user
    if not user.is_authenticated:
        return _error(401, "not_authenticated", "log in to the admin to read the dashboard")
    if not (user.is_active and user.is_staff):
        return _error(403, "permission_denied", "the dashboard is for staff users")
    if request.method not in ("GET", "HEAD"):
        response = _error(405, "method_not_allowed", f"method {request.method} is not allowed here")
        response["Allow"] = "GET, HEAD"
        return response
    try:
        snapshot = dashboard_snapshot()
    except Exception:  # a database hiccup must not answer 500 to a page polling every few seconds
        logger.exception("dashboard snapshot failed")
        return _error(503, "dashboard_unavailable", "the dashboard could not be read; it is retried shortly")
    return JsonResponse(snapshot)


urlpatterns = [
    path("", admin.site.admin_view(dashboard_page), name="index"),
    path("data/", dashboard_data, name="data"),
]
