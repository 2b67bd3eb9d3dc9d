"""The console's side of gated pipelines: the run page's pipeline panel (phases, receipts, pins,
drift, keys), the sidecar download, and read-only lists of receipts, pins, drift and phase keys.
(The acknowledge-drift and void actions are runbooks: ``runs.runbooks``.)"""

from __future__ import annotations

from django.contrib import admin
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from core.admin import ReadOnlyAdmin
from core.admin_runbooks import object_path, recent_filter
from runs.models import ContextPin, DriftRecord, GateReceipt, PhaseRecord, PipelineKey, Run
from runs.pipeline.sidecar import sidecar_json


class RunPipelineAdminMixin:
    """Adds to the run admin: the pipeline panel and ``<id>/sidecar/``."""

    def get_urls(self):
        return [object_path(self, "sidecar", self.sidecar_view, "sidecar"), *super().get_urls()]

    def sidecar_view(self, request, object_id):
        """The run's sidecar (seed 002 §5) as a JSON download; the view permission suffices."""
        run = self.get_object(request, unquote(object_id))
        if run is None:
            raise Http404(f"run {object_id} does not exist")
        if not self.has_view_permission(request, run):
            raise PermissionDenied
        response = HttpResponse(sidecar_json(run), content_type="application/json")
        response["Content-Disposition"] = f'attachment; filename="run-{run.pk}-sidecar.json"'
        return response

    @admin.display(description="gated pipeline")
    def pipeline_record(self, run: Run):
        """Phases with their gate receipts, current pins, drift and phase keys, and the sidecar link."""
        if not run.gated:
            return "not a gated pipeline (no gates, pins or caps in its plan)"
        current = {"run": run, "attempt_number": run.attempt_number}
        receipts: dict[int | None, list[GateReceipt]] = {}
        for receipt in GateReceipt.objects.filter(**current).order_by("id"):
            receipts.setdefault(receipt.phase_id, []).append(receipt)

        def receipt_item(receipt: GateReceipt):
            held = ", ".join(f"{name} {'✓' if ok else '✗'}" for name, ok in receipt.invariants.items())
            return (receipt.kind, receipt.gate, receipt.check_name, "passed" if receipt.passed else "FAILED", held,
                    receipt.finished_at)

        def phase_item(phase: PhaseRecord):
            cap = f", soft cap {phase.soft_cap_minutes:g} min" if phase.soft_cap_minutes is not None else ""
            used = f", ran {phase.active_ms / 1000:.1f} s" if phase.active_ms is not None else ""
            return (phase.name, phase.result, cap + used,
                    format_html_join("", "<li>{} {} ({}): {} — {} <small>{}</small></li>",
                                     (receipt_item(r) for r in receipts.get(phase.pk, []))))

        phases = PhaseRecord.objects.filter(**current).order_by("started_at", "id")
        pins = ContextPin.objects.filter(**current).order_by("dimension", "id")
        drift = DriftRecord.objects.filter(**current).order_by("id")
        keys = PipelineKey.objects.filter(run=run).order_by("id")
        url = reverse(f"admin:{run._meta.app_label}_{run._meta.model_name}_sidecar", args=[quote(run.pk)])
        return format_html(
            '<p>Mode <strong>{}</strong> · <a href="{}" download>Download the sidecar (JSON)</a></p>'
            "<p><strong>Phases</strong></p><ul>{}</ul>"
            "<p><strong>Pins</strong></p><ul>{}</ul>"
            "<p><strong>Drift</strong></p><ul>{}</ul>"
            "<p><strong>Phase keys</strong></p><ul>{}</ul>",
            run.mode, url,
            format_html_join("", "<li>{} [{}]{}<ul>{}</ul></li>", (phase_item(p) for p in phases))
            or format_html("<li>{}</li>", "none started"),
            format_html_join("", "<li>{} = <code>{}</code> ({}, {}{})</li>", (
                (p.dimension, p.value, p.source, p.actor_label,
                 f", superseded {p.superseded_at:%Y-%m-%d %H:%M:%S}" if p.superseded_at else "") for p in pins))
            or format_html("<li>{}</li>", "none"),
            format_html_join("", "<li>{}: recorded <code>{}</code>, live <code>{}</code> — {}{}</li>", (
                (d.dimension, d.recorded, d.live, d.status,
                 f" by {d.actor_label}: {d.reason}" if d.status == DriftRecord.Status.ACKNOWLEDGED else "")
                for d in drift)) or format_html("<li>{}</li>", "none"),
            format_html_join("", "<li>{}: <code>{}</code>{}</li>", (
                (k.phase, k.key, f" (released: {k.released_reason})" if k.released_at else "") for k in keys))
            or format_html("<li>{}</li>", "none"),
        )


@admin.register(GateReceipt)
class GateReceiptAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "attempt_number", "kind", "gate", "check_name", "passed", "mode", "finished_at")
    list_filter = ("passed", "kind", "check_name", recent_filter("finished_at", "finished"))
    search_fields = ("=run__id", "gate", "check_name")
    show_full_result_count = False


@admin.register(ContextPin)
class ContextPinAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "attempt_number", "dimension", "provider", "value", "source", "actor_label",
                    "recorded_at", "superseded_at")
    list_filter = ("provider", "source")
    search_fields = ("=run__id", "dimension")
    show_full_result_count = False


@admin.register(DriftRecord)
class DriftRecordAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "attempt_number", "dimension", "kind", "recorded", "live", "status",
                    "detected_at", "actor_label", "acknowledged_at")
    list_filter = ("status", "kind", recent_filter("detected_at", "detected"))
    search_fields = ("=run__id", "dimension")
    show_full_result_count = False


@admin.register(PhaseRecord)
class PhaseRecordAdmin(ReadOnlyAdmin):
    list_display = ("id", "run_id", "attempt_number", "name", "result", "soft_cap_minutes", "started_at",
                    "finished_at", "cap_escalated_at")
    list_filter = ("result", recent_filter("started_at", "started"))
    search_fields = ("=run__id", "name")
    show_full_result_count = False


@admin.register(PipelineKey)
class PipelineKeyAdmin(ReadOnlyAdmin):
    list_display = ("id", "key", "run_id", "phase", "claimed_at", "released_at", "released_reason")
    search_fields = ("=run__id", "key", "phase")
    show_full_result_count = False
