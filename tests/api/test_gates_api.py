"""Gated pipelines through the API: a seed-002 pipeline approved over HTTP, the refusals, drift
acknowledged and resumed, void, dry runs and the sidecar, each error in the one JSON shape."""

from __future__ import annotations

import jsonschema
import pytest

from runs.models import GateReceipt, PipelineKey, Run
from runs.pipeline.sidecar import sidecar_schema
from tests.api.conftest import assert_error
from tests.drive import drain_jobs
from tests.runs.test_gates import files, http_url, seed_002_plan, small_plan  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)


def create_and_start(tenant, plan, **body) -> int:
    created = tenant.client.post("/api/v1/runs/", tenant.run_body(plan=plan, **body), format="json")
    assert created.status_code == 201, created.json()
    run_id = created.json()["id"]
    assert tenant.client.post(f"/api/v1/runs/{run_id}/start/", format="json").status_code == 200
    return run_id


def drive_until(run_id, predicate):
    drain_jobs(until=lambda: predicate(Run.objects.get(pk=run_id)), timeout=30)


def reason_is(value):
    return lambda run: run.status_reason == value


def settled(run):
    return run.status in (Run.Status.COMPLETED, Run.Status.FAILED, Run.Status.CANCELLED)


def test_a_seed_002_pipeline_completes_with_its_approvals_given_through_the_api(tenant, files, http_url):
    manifest, backup = files
    run_id = create_and_start(tenant, seed_002_plan(manifest, backup, http_url))
    drive_until(run_id, reason_is("awaiting_approval:SG_cut_authz"))
    body = tenant.client.get(f"/api/v1/runs/{run_id}/").json()
    assert (body["status"], body["status_reason"], body["mode"]) == ("paused", "awaiting_approval:SG_cut_authz",
                                                                     "live")
    assert body["pipeline"]["awaiting_approval"] == ["SG_cut_authz"]
    assert [g["gate"] for g in body["pipeline"]["gates_passed"]] == ["IG_source_pin", "IG_mark", "IG_cutplan",
                                                                      "IG_backup", "IG_grant_probe"]
    assert set(body["pipeline"]["pins"]) == {"manifest", "plan_digest", "backup_sha"}

    approved = tenant.client.post(f"/api/v1/runs/{run_id}/approve/",
                                  {"gate": "SG_cut_authz", "approval_ref": "KB-CUT-7", "reason": "signed"},
                                  format="json")
    assert approved.status_code == 200 and approved.json()["status"] == "resuming"
    drive_until(run_id, reason_is("awaiting_approval:SG_lifecycle_authz"))
    resumed = tenant.client.post(f"/api/v1/runs/{run_id}/resume/",
                                 {"approval_ref": "KB-LIFE-7", "reason": "review decision 7"}, format="json")
    assert resumed.status_code == 200 and resumed.json()["status"] == "resuming"
    drive_until(run_id, settled)

    body = tenant.client.get(f"/api/v1/runs/{run_id}/").json()
    assert body["status"] == "completed" and body["pipeline"]["awaiting_approval"] == []
    gates = [g["gate"] for g in body["pipeline"]["gates_passed"]]
    assert len(gates) == 10 and len(set(gates)) == 10
    assert GateReceipt.objects.filter(run_id=run_id, passed=True).count() == 10

    sidecar = tenant.client.get(f"/api/v1/runs/{run_id}/sidecar/").json()
    jsonschema.validate(sidecar, sidecar_schema())
    assert [(a["gate"], a["approval_kb_id"]) for a in sidecar["sovereign_approvals"]] == [
        ("SG_cut_authz", "KB-CUT-7"), ("SG_lifecycle_authz", "KB-LIFE-7")]
    assert sidecar["phases"]["mark"]["gate_invariants"] == {"IG_mark.pin_recorded": True, "IG_mark.equals": True}
    assert sidecar["idempotency_keys"]["cut_leg_a"] == "change-set-ICX-001"


def test_approvals_are_refused_when_missing_reused_or_for_another_gate(tenant, files):
    manifest, _ = files
    plan = small_plan(manifest, middle={"name": "ask", "kind": "approval", "gate": "SG_one"})
    plan["agents"][0]["tasks"][2]["steps"].insert(0, {"name": "ask", "kind": "approval", "gate": "SG_two"})
    run_id = create_and_start(tenant, plan)
    drive_until(run_id, reason_is("awaiting_approval:SG_one"))
    url = f"/api/v1/runs/{run_id}"

    missing = assert_error(tenant.client.post(f"{url}/resume/", {"reason": "go"}, format="json"), 409,
                           "approval_required")
    assert missing["gate"] == "SG_one"
    assert_error(tenant.client.post(f"{url}/approve/", {"gate": "SG_two", "approval_ref": "KB-1"}, format="json"),
                 409, "approval_not_pending")
    body = assert_error(tenant.client.post(f"{url}/approve/", {"gate": "SG_one"}, format="json"), 400,
                        "validation_error")
    assert "approval_ref" in body["errors"]
    assert tenant.client.post(f"{url}/approve/", {"gate": "SG_one", "approval_ref": "KB-1"},
                              format="json").status_code == 200
    drive_until(run_id, reason_is("awaiting_approval:SG_two"))
    reused = assert_error(tenant.client.post(f"{url}/approve/", {"gate": "SG_two", "approval_ref": "KB-1"},
                                             format="json"), 409, "approval_reused")
    assert (reused["run"], reused["gate"]) == (run_id, "SG_one")
    other = create_and_start(tenant, plan)
    drive_until(other, reason_is("awaiting_approval:SG_one"))
    assert_error(tenant.client.post(f"/api/v1/runs/{other}/resume/", {"gate": "SG_one", "approval_ref": "KB-1"},
                                    format="json"), 409, "approval_reused")
    assert Run.objects.get(pk=other).status == Run.Status.PAUSED
    assert tenant.client.post(f"{url}/approve/", {"gate": "SG_two", "approval_ref": "KB-2"},
                              format="json").status_code == 200
    drive_until(run_id, settled)
    assert Run.objects.get(pk=run_id).status == Run.Status.COMPLETED


def test_drift_stops_the_run_resume_is_refused_until_acknowledged(tenant, files):
    manifest, _ = files
    run_id = create_and_start(tenant, small_plan(manifest))
    drive_until(run_id, lambda run: GateReceipt.objects.filter(run=run, gate="IG_one").exists())
    manifest.write_text("a newer manifest\n")
    drive_until(run_id, reason_is("stopped_drift:manifest"))
    url = f"/api/v1/runs/{run_id}"
    body = tenant.client.get(f"{url}/").json()
    assert body["pipeline"]["drift"][0]["dimension"] == "manifest" and body["pipeline"]["drift"][0]["status"] == "open"

    refused = assert_error(tenant.client.post(f"{url}/resume/", {"reason": "go"}, format="json"), 409,
                           "drift_unacknowledged")
    assert refused["dimension"] == "manifest" and refused["recorded"] != refused["live"]
    assert "reason" in assert_error(tenant.client.post(f"{url}/acknowledge-drift/", {}, format="json"), 400,
                                    "validation_error")["errors"]
    acknowledged = tenant.client.post(f"{url}/acknowledge-drift/", {"reason": "new manifest approved"},
                                      format="json")
    assert acknowledged.status_code == 200
    assert acknowledged.json()["pipeline"]["pins"]["manifest"] == refused["live"]
    assert_error(tenant.client.post(f"{url}/acknowledge-drift/", {"reason": "again"}, format="json"), 409,
                 "drift_not_pending")
    assert tenant.client.post(f"{url}/resume/", {"reason": "go"}, format="json").json()["status"] == "resuming"
    drive_until(run_id, settled)
    assert Run.objects.get(pk=run_id).status == Run.Status.COMPLETED


def test_void_a_stopped_run_and_refuse_a_live_one(tenant, files):
    manifest, _ = files
    plan = small_plan(manifest, middle={"name": "ask", "kind": "approval", "gate": "SG_go"}, key="CS-77")
    run_id = create_and_start(tenant, plan)
    drive_until(run_id, reason_is("awaiting_approval:SG_go"))
    url = f"/api/v1/runs/{run_id}"
    assert "reason" in assert_error(tenant.client.post(f"{url}/void/", {}, format="json"), 400,
                                    "validation_error")["errors"]
    second = tenant.client.post("/api/v1/runs/", tenant.run_body(plan=plan), format="json").json()["id"]
    held = assert_error(tenant.client.post(f"/api/v1/runs/{second}/start/", format="json"), 409,
                        "pipeline_key_in_use")
    assert (held["key"], held["run"]) == ("CS-77", run_id)

    body = tenant.client.post(f"{url}/void/", {"reason": "wrong change set"}, format="json").json()
    assert (body["status"], body["status_reason"]) == ("cancelled", "voided:wrong change set")
    assert body["credits_charged"] + body["credits_refunded"] == body["credits_reserved"]
    assert tenant.client.post(f"/api/v1/runs/{second}/start/", format="json").json()["status"] == "pending"
    assert PipelineKey.objects.get(key="CS-77", released_at__isnull=True).run_id == second
    refused = assert_error(tenant.client.post(f"/api/v1/runs/{second}/void/", {"reason": "x"}, format="json"), 409,
                           "invalid_transition")
    assert (refused["from"], refused["to"]) == ("pending", "void")

    sidecar = tenant.client.get(f"{url}/sidecar/").json()
    jsonschema.validate(sidecar, sidecar_schema())
    assert sidecar["state"] == "cancelled" and sidecar["released_idempotency_keys"] == ["run:%d:phase:phase_one"
                                                                                        % run_id, "CS-77",
                                                                                        "run:%d:phase:phase_three"
                                                                                        % run_id]


def test_a_dry_run_through_the_api(tenant, files):
    manifest, _ = files
    run_id = create_and_start(tenant, small_plan(manifest), mode="dryrun")
    drive_until(run_id, settled)
    body = tenant.client.get(f"/api/v1/runs/{run_id}/").json()
    assert (body["status"], body["mode"], body["credits_charged"]) == ("completed", "dryrun", 0)
    assert_error(tenant.client.post("/api/v1/runs/", tenant.run_body(plan=small_plan(manifest), mode="rehearse"),
                                    format="json"), 400, "validation_error")


def test_another_organizations_run_is_not_found_on_every_gate_endpoint(tenant, tenant_factory, files):
    manifest, _ = files
    run_id = create_and_start(tenant, small_plan(manifest))
    stranger = tenant_factory()
    for path, data in (("resume/", {}), ("acknowledge-drift/", {"reason": "x"}), ("void/", {"reason": "x"})):
        assert_error(stranger.client.post(f"/api/v1/runs/{run_id}/{path}", data, format="json"), 404, "not_found")
    assert_error(stranger.client.get(f"/api/v1/runs/{run_id}/sidecar/"), 404, "not_found")


def test_a_member_may_watch_a_gated_run_but_only_an_owner_or_an_operator_approves(tenant, files, django_user_model):
    from django.contrib.auth.models import Permission
    from rest_framework.authtoken.models import Token

    from core.models import Membership
    from tests.api.conftest import token_client

    manifest, _ = files
    run_id = create_and_start(tenant, small_plan(manifest, middle={"name": "ask", "kind": "approval",
                                                                   "gate": "SG_one"}))
    drive_until(run_id, reason_is("awaiting_approval:SG_one"))
    url = f"/api/v1/runs/{run_id}"
    member = django_user_model.objects.create_user(username="a-program")
    Membership.objects.create(organization=tenant.organization, user=member, role=Membership.Role.MEMBER)
    program = token_client(Token.objects.create(user=member).key)

    assert program.get(f"{url}/").status_code == 200
    approval = {"gate": "SG_one", "approval_ref": "KB-M1", "reason": "mine"}
    body = assert_error(program.post(f"{url}/approve/", approval, format="json"), 403, "permission_denied")
    assert body["permission"] == "runs.approve_gate"
    assert_error(program.post(f"{url}/resume/", approval, format="json"), 403, "permission_denied")
    assert_error(program.post(f"{url}/acknowledge-drift/", {"reason": "fine"}, format="json"), 403,
                 "permission_denied")
    assert program.post(f"{url}/resume/", {"reason": "go"}, format="json").status_code == 409  # approval_required
    assert Run.objects.get(pk=run_id).status_reason == "awaiting_approval:SG_one"

    member.user_permissions.add(Permission.objects.get(content_type__app_label="runs", codename="approve_gate"))
    program = token_client(Token.objects.get(user=member).key)
    assert program.post(f"{url}/approve/", approval, format="json").status_code == 200
    drive_until(run_id, settled)
    assert Run.objects.get(pk=run_id).status == Run.Status.COMPLETED
