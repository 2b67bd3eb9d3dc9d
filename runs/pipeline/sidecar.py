"""A run's full record as seed 002's JSON sidecar (§5), ``schema_version`` 1.

``sidecar_build`` reads the run's current attempt: its phases (a task is a phase) with their
gate invariants and receipts, approvals, phase idempotency keys, context pins (and their
history), drift, and last error. The document's JSON Schema is ``runs/sidecar.schema.json``;
``manage.py export_run`` writes it, the admin offers it as a download and the API serves it at
``GET runs/{id}/sidecar/``.
"""

from __future__ import annotations

import json
from datetime import timezone as dt_timezone
from pathlib import Path
from typing import Any

from django.utils import timezone

from runs.models import ApprovalRequest, ContextPin, DriftRecord, GateReceipt, PhaseRecord, PipelineKey, Run

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("sidecar.schema.json")


def _utc(value) -> str | None:
    if value is None:
        return None
    return value.astimezone(dt_timezone.utc).isoformat().replace("+00:00", "Z")


def sidecar_schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def _receipt(receipt: GateReceipt) -> dict[str, Any]:
    return {"gate": receipt.gate, "check": receipt.check_name, "kind": receipt.kind, "passed": receipt.passed,
            "invariants": receipt.invariants, "details": receipt.details, "pins": receipt.pins,
            "mode": receipt.mode, "started_utc": _utc(receipt.started_at), "finished_utc": _utc(receipt.finished_at)}


def _phases(run: Run) -> dict[str, dict]:
    receipts: dict[int, list[GateReceipt]] = {}
    for receipt in GateReceipt.objects.filter(run=run, attempt_number=run.attempt_number).order_by("id"):
        receipts.setdefault(receipt.phase_id, []).append(receipt)
    phases = {}
    for phase in PhaseRecord.objects.filter(run=run, attempt_number=run.attempt_number).order_by("started_at", "id"):
        invariants: dict[str, bool] = {}
        for receipt in receipts.get(phase.pk, []):
            if receipt.kind == GateReceipt.Kind.GATE:
                invariants.update({f"{receipt.gate}.{name}": held for name, held in receipt.invariants.items()})
        phases[phase.name] = {
            "phase": phase.name,
            "started_utc": _utc(phase.started_at),
            "finished_utc": _utc(phase.finished_at),
            "result": phase.result,
            "gate_invariants": invariants,
            "kb_doc_id": None,
            "artifacts": [],
            "soft_cap_minutes": phase.soft_cap_minutes,
            "active_ms": phase.active_ms,
            "receipts": [_receipt(r) for r in receipts.get(phase.pk, [])],
        }
    return phases


def _approval(request: ApprovalRequest) -> dict[str, Any]:
    return {"gate": request.gate, "requested_utc": _utc(request.requested_at), "approval_kb_id": request.approval_ref,
            "review_decision_id": None, "validated_utc": _utc(request.approved_at),
            "approved_by": request.approved_by.get_username() if request.approved_by else None,
            "asked": request.asked}


def _last_error(run: Run) -> dict[str, Any] | None:
    if not run.last_error_code:
        return None
    error: dict[str, Any] = {"code": run.last_error_code, "message": run.last_error}
    if run.last_error_code.startswith("gate_failed:"):
        failed = (GateReceipt.objects.filter(run=run, attempt_number=run.attempt_number, passed=False,
                                             kind=GateReceipt.Kind.GATE).order_by("-id").first())
        if failed is not None:
            error["gate"] = failed.gate
            error["invariants"] = failed.broken
    return error


def sidecar_build(run: Run) -> dict[str, Any]:
    """The sidecar document of ``run`` (JSON-ready)."""
    run = Run.objects.select_related("created_by").get(pk=run.pk)
    approvals = list(ApprovalRequest.objects.filter(run=run, attempt_number=run.attempt_number)
                     .select_related("approved_by").order_by("id"))
    pins = list(ContextPin.objects.filter(run=run, attempt_number=run.attempt_number).order_by("id"))
    return {
        "run_id": str(run.pk),
        "created_utc": _utc(run.created_at),
        "created_by": run.created_by.get_username() if run.created_by else "system",
        "name": run.name,
        "organization": run.organization_id,
        "project": run.project_id,
        "attempt": run.attempt_number,
        "mode": run.mode,
        "state": run.status,
        "status_reason": run.status_reason or None,
        "phases": _phases(run),
        "sovereign_approvals": [_approval(a) for a in approvals if a.status == ApprovalRequest.Status.APPROVED],
        "pending_approvals": [_approval(a) for a in approvals if a.status == ApprovalRequest.Status.PENDING],
        "idempotency_keys": {key.phase: key.key for key in PipelineKey.objects.filter(run=run).order_by("id")},
        "released_idempotency_keys": [key.key for key in PipelineKey.objects.filter(run=run, released_at__isnull=False)
                                      .order_by("id")],
        "context_pins": {pin.dimension: pin.value for pin in pins if pin.superseded_at is None},
        "context_pin_history": [{
            "dimension": pin.dimension, "value": pin.value, "provider": pin.provider, "source": pin.source,
            "recorded_utc": _utc(pin.recorded_at), "recorded_by": pin.actor_label, "reason": pin.reason,
            "superseded_utc": _utc(pin.superseded_at)} for pin in pins],
        "drift": [{
            "dimension": d.dimension, "kind": d.kind, "recorded": d.recorded, "live": d.live,
            "detected_before": d.detected_before, "detected_utc": _utc(d.detected_at), "status": d.status,
            "acknowledged_utc": _utc(d.acknowledged_at), "acknowledged_by": d.actor_label or None,
            "reason": d.reason or None}
            for d in DriftRecord.objects.filter(run=run, attempt_number=run.attempt_number).order_by("id")],
        "last_error": _last_error(run),
        "exported_utc": _utc(timezone.now()),
        "schema_version": SCHEMA_VERSION,
    }


def sidecar_json(run: Run) -> str:
    return json.dumps(sidecar_build(run), indent=2, sort_keys=False, ensure_ascii=False) + "\n"
