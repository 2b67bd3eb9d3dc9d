"""A run driven through its whole life by the services settles its credits."""

from billing.selectors import account_balance
from runs import services
from runs.models import Run
from tests.conftest import make_plan


def test_run_lifecycle_settles_credits(project):
    run = services.run_create(project=project, name="smoke", plan=make_plan(steps=2))
    services.run_start(run_id=run.pk)
    services.run_mark_running(run_id=run.pk)
    for _ in range(2):
        step = services.runnable_steps(Run.objects.get(pk=run.pk))[0]
        attempt = services.step_begin(step_id=step.pk)
        services.step_attempt_succeed(attempt_id=attempt.pk, output={"ok": True})
    run.refresh_from_db()
    assert run.status == Run.Status.COMPLETED
    assert (run.credits_reserved, run.credits_charged, run.credits_refunded) == (6, 2, 4)
    assert account_balance(organization_id=project.organization_id) == {
        "organization": project.organization_id, "balance": 998, "reserved": 0, "available": 998}
