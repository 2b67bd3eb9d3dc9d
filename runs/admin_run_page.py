"""The run page's top and its pictures: what an operator needs first, the Gantt chart of its
step tries, and the task graph of its ``dag`` agents.

- The summary at the top (``admin/runs/run_summary.html``): status and reason, last error, age
  and time in its state, credits reserved / charged / refunded / held of the limit, attempt,
  re-plans, an open incident, and the runbook buttons that apply — read from the run row the
  page loads anyway (no query of its own).
- The Gantt chart (``runs/static/runs/timeline.js``) draws ``<id>/timeline/``: the same pages
  of step tries ``GET /api/v1/runs/{id}/timeline/`` answers, for anyone who may view the run
  in the admin. A lane per step, grouped by attempt, agent and task; a bar per try, coloured by
  its status; it is fetched again (throttled) when an event of this run arrives.
- The task graph of each ``dag`` agent of the current attempt: an inline SVG drawn from the
  hierarchy the page reads once (``run_hierarchy``, shared with the tree).
"""

from __future__ import annotations

from collections import defaultdict

from django.contrib import admin
from django.contrib.admin.utils import unquote
from django.core.exceptions import PermissionDenied
from django.http import Http404, JsonResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import escape, format_html
from django.utils.safestring import mark_safe
from django.utils.timesince import timesince

from runs.api.timeline import TimelineQuerySerializer, timeline_page
from runs.models import Agent, ParallelismMode, Run, Task
from runs.selectors import run_hierarchy, run_held_credits

NODE_W, NODE_H, GAP_X, GAP_Y, PAD = 150, 30, 60, 16, 8


def run_hierarchy_cached(run: Run):
    """``run_hierarchy(run)``, read once per page (the tree and the task graph share it)."""
    cached = getattr(run, "_hierarchy_cache", None)
    if cached is None:
        cached = run._hierarchy_cache = run_hierarchy(run)
    return cached


def _layers(tasks: list[Task]) -> dict[str, int]:
    """Each task's column: the longest chain of ``depends_on`` before it (unknown names ignored)."""
    by_name = {task.name: task for task in tasks}
    depth: dict[str, int] = {}

    def column(name: str, seen: frozenset) -> int:
        if name in depth:
            return depth[name]
        parents = [parent for parent in by_name[name].depends_on or [] if parent in by_name and parent not in seen]
        depth[name] = 1 + max((column(parent, seen | {name}) for parent in parents), default=-1)
        return depth[name]

    for task in tasks:
        column(task.name, frozenset())
    return depth


def task_graph_svg(agent: Agent, tasks: list[Task]) -> str:
    """An SVG drawing of ``tasks`` as boxes in dependency columns, with an arrow per ``depends_on``."""
    depth = _layers(tasks)
    rows: dict[int, int] = defaultdict(int)
    place = {}
    for task in tasks:
        column = depth[task.name]
        place[task.name] = (PAD + column * (NODE_W + GAP_X), PAD + rows[column] * (NODE_H + GAP_Y))
        rows[column] += 1
    width = PAD * 2 + (max(depth.values(), default=0) + 1) * (NODE_W + GAP_X) - GAP_X
    height = PAD * 2 + max(rows.values(), default=1) * (NODE_H + GAP_Y) - GAP_Y
    marker = f"dag-arrow-{agent.pk}"
    parts = [f'<svg class="task-graph" data-agent="{agent.pk}" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="tasks of agent {escape(agent.name)}">',
             f'<defs><marker id="{marker}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
             f'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z"/></marker></defs>']
    for task in tasks:
        x2, y2 = place[task.name]
        for parent in task.depends_on or []:
            if parent not in place:
                continue
            x1, y1 = place[parent]
            sx, sy, ex, ey = x1 + NODE_W, y1 + NODE_H / 2, x2, y2 + NODE_H / 2
            mid = (sx + ex) / 2
            parts.append(f'<path class="dag-edge" data-from="{escape(parent)}" data-to="{escape(task.name)}" '
                         f'd="M {sx} {sy} C {mid} {sy}, {mid} {ey}, {ex - 2} {ey}" marker-end="url(#{marker})"/>')
    for task in tasks:
        x, y = place[task.name]
        label = task.name if len(task.name) <= 20 else task.name[:19] + "…"
        parts.append(f'<g class="dag-node dag-{escape(task.status)}" data-task="{task.pk}">'
                     f'<title>task {escape(task.name)}: {escape(task.status)}'
                     f'{escape(" — " + task.last_error_code) if task.last_error_code else ""}</title>'
                     f'<rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="5"/>'
                     f'<text x="{x + NODE_W / 2}" y="{y + NODE_H / 2 + 4}">{escape(label)}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


def _ago(moment, now=None) -> str:
    """``42 s ago``, ``7 min ago``, ``3 h 5 min ago``, ``2 days, 4 hours ago``."""
    if not moment:
        return "—"
    seconds = max(0, int(((now or timezone.now()) - moment).total_seconds()))
    if seconds < 60:
        return f"{seconds} s ago"
    if seconds < 3600:
        return f"{seconds // 60} min ago"
    if seconds < 86400:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min ago"
    return f"{timesince(moment, now or timezone.now())} ago"


class RunPageAdminMixin:
    """The run page's summary, Gantt chart, task graph and ``<id>/timeline/`` (JSON)."""

    change_form_template = "admin/runs/run_change_form.html"

    def get_urls(self):
        opts = self.model._meta
        urls = [path("<path:object_id>/timeline/", self.admin_site.admin_view(self.timeline_view),
                     name=f"{opts.app_label}_{opts.model_name}_timeline")]
        return urls + super().get_urls()

    def timeline_view(self, request, object_id):
        """A page of the run's step tries, as the API's timeline; the view permission suffices."""
        run = (self.get_queryset(request).filter(pk=object_id).defer("plan").first()
               if str(object_id).isdigit() and int(object_id) < 2**63 else None)
        if run is None:
            raise Http404(f"run {unquote(object_id)} does not exist")
        if not self.has_view_permission(request, run):
            raise PermissionDenied
        query = TimelineQuerySerializer(data=request.GET)
        if not query.is_valid():
            return JsonResponse({"code": "validation_error", "detail": "invalid query", "errors": query.errors},
                                status=400)
        base = request.build_absolute_uri(request.path)
        limit = query.validated_data["limit"]
        return JsonResponse(timeline_page(run, limit=limit, after=query.validated_data.get("cursor"),
                                          next_url=lambda cursor: f"{base}?limit={limit}&cursor={cursor}"))

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra_context = dict(extra_context or {})
        run = self.get_object(request, unquote(object_id))
        if run is not None:
            extra_context["run_summary"] = self.run_summary(run)
        return super().change_view(request, object_id, form_url, extra_context)

    def run_summary(self, run: Run) -> dict:
        """What an operator needs first, from the run row alone."""
        finished = run.completed_at or run.cancelled_at
        return {
            "run": run,
            "age": _ago(run.created_at),
            "in_state": _ago(run.status_changed_at),
            "heartbeat": _ago(run.last_heartbeat) if run.last_heartbeat else "never",
            "finished": finished,
            "duration_s": round(run.duration_ms / 1000, 1) if run.duration_ms is not None else None,
            "held": run_held_credits(run),
            "last_error": (run.last_error[:300] + ("…" if len(run.last_error) > 300 else "")) if run.last_error else "",
            "escalated": getattr(run, "has_open_escalation", None),
            "escalations_url": reverse("admin:runs_escalationticket_changelist") + f"?run__id__exact={run.pk}",
            "timeline_url": reverse("admin:runs_run_timeline", args=[run.pk]),
        }

    @admin.display(description="step tries")
    def gantt(self, run: Run):
        """The container the Gantt script draws into (the tries are fetched, not rendered here)."""
        return format_html(
            '<div class="run-gantt" id="run-gantt" data-run="{}" data-timeline-url="{}">'
            '<p class="run-gantt-status help">loading the step tries…</p>'
            '<noscript>the timeline needs JavaScript: <a href="{}">its data</a></noscript></div>',
            run.pk, reverse("admin:runs_run_timeline", args=[run.pk]),
            reverse("admin:runs_run_timeline", args=[run.pk]))

    @admin.display(description="task graph")
    def task_graph(self, run: Run):
        """The ``depends_on`` graph of each ``dag`` agent of the current attempt."""
        agents, tasks, _steps = run_hierarchy_cached(run)
        drawn = [agent for agent in agents if agent.attempt_number == run.attempt_number
                 and agent.parallelism_mode == ParallelismMode.DAG and tasks[agent.pk]]
        if not drawn:
            return "no dag agent in the current attempt"
        return mark_safe("".join(
            f'<div class="task-graph-agent"><p>agent <strong>{escape(agent.name)}</strong> '
            f'<span class="run-node-{escape(agent.status)}">[{escape(agent.status)}]</span></p>'
            f'{task_graph_svg(agent, tasks[agent.pk])}</div>' for agent in drawn))
