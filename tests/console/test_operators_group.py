"""The "Operators" group made by the runs migration: every runbook permission and the view
permission on every model of our apps (``core.view_event`` too, for the live socket)."""

from __future__ import annotations

import pytest
from django.apps import apps
from django.contrib.auth.models import Group

pytestmark = pytest.mark.django_db

RUNBOOK_PERMISSIONS = {
    "runs.start_run", "runs.force_fail_run", "runs.cancel_run", "runs.pause_run", "runs.resume_run", "runs.retry_run",
    "runs.escalate_run", "runs.recover_run", "runs.approve_gate", "runs.manage_escalation",
    "runs.acknowledge_drift", "runs.void_run", "billing.refund_run",
    "jobs.requeue_job", "jobs.fail_job", "jobs.cancel_job", "jobs.pause_queue", "diagnosis.request_suggestion",
}


def test_operators_hold_the_runbook_permissions_and_view_everything(make_staff):
    operators = Group.objects.get(name="Operators")
    granted = {f"{perm.content_type.app_label}.{perm.codename}" for perm in operators.permissions.all()}
    views = {f"{model._meta.app_label}.view_{model._meta.model_name}"
             for app_label in ("core", "billing", "jobs", "runs", "diagnosis")
             for model in apps.get_app_config(app_label).get_models()}
    assert "core.view_event" in views
    assert granted == RUNBOOK_PERMISSIONS | views
    member = make_staff("member", group="Operators", view=False)
    assert member.has_perms(sorted(RUNBOOK_PERMISSIONS | views))
    assert not member.has_perm("billing.topup_credits") and not member.has_perm("runs.change_run")
