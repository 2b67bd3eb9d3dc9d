"""The job runbooks: requeue, fail or cancel a stuck job, registered by ``JobsConfig.ready``.

Each plans the change on one job and performs it through ``jobs.services``, which locks the
row, follows seed 000's transition matrix and writes the audit record; its declaration also
gives the admin action and button, the permission and the command (``core.runbooks``). Jobs
hold no credits: the plan names the run a job works for, if any.
"""

from __future__ import annotations

from functools import partial

from django.utils import timezone

from core.runbooks import Plan, Runbook, by_id, runbook_register, transition
from core.services import actor_label
from jobs import services
from jobs.models import TERMINAL_JOB_STATES, WAITING_JOB_STATES, Job, JobReason, JobState


def _age(job: Job) -> str:
    since = job.started_at if job.state == JobState.EXECUTING else (job.queued_at or job.created_at)
    if since is None:
        return job.state
    return f"{job.state} for {int((timezone.now() - since).total_seconds())} s"


def _credits(job: Job) -> str:
    return f"no credits move (works for run {job.run_id})" if job.run_id else "no credits move"


def _ended(job: Job) -> str:
    return f"already ended ({job.state})" if job.state in TERMINAL_JOB_STATES else ""


def _requeue_plan(job: Job, options: dict) -> Plan:
    skip = f"already waiting ({job.state})" if job.state in WAITING_JOB_STATES else _ended(job)
    refusal = "" if job.state == JobState.EXECUTING or skip else "only executing jobs can be requeued"
    return Plan(current=_age(job), change=f"{job.state} → awaiting_tool (claimable now; the lane and slot are freed)",
                credits=_credits(job), skip=skip, refusal=refusal)


JobRunbook = partial(Runbook, model=Job, noun="job", state_field="state")

JOB_REQUEUE = JobRunbook(
    name="requeue", title="Requeue", permission="jobs.requeue_job", permission_label="Can requeue a stuck job",
    plan=_requeue_plan, perform=transition(by_id(services.job_requeue, "job_id"), state_field="state"),
    action_label="Requeue selected stuck jobs…", command="requeue_job",
    description="Put stuck executing jobs back to wait (executing → awaiting_tool, claimable now).")


def _fail_plan(job: Job, options: dict) -> Plan:
    return Plan(current=_age(job), change=f"{job.state} → failed ({JobReason.FATAL})", credits=_credits(job),
                skip=_ended(job))


def _fail(job: Job, *, actor, reason: str, options: dict) -> Job:
    return services.job_fail(job_id=job.pk, reason=JobReason.FATAL,
                             error=f"failed by operator {actor_label(actor)}: {reason}", actor=actor,
                             audit_reason=reason)


JOB_FAIL = JobRunbook(
    name="fail", title="Fail", permission="jobs.fail_job", permission_label="Can fail a stuck job",
    plan=_fail_plan, perform=transition(_fail, state_field="state"), command="fail_job",
    description="Fail jobs that have not ended (reason fatal_error; the error names you and your reason).")


def _cancel_plan(job: Job, options: dict) -> Plan:
    if job.state == JobState.EXECUTING:
        change = "executing → cancel requested (the worker stops it, or it is cancelled after its graceful window)"
    else:
        change = f"{job.state} → cancelled"
    skip = "already cancelled" if job.state == JobState.CANCELLED else _ended(job)
    if not skip and job.cancel_requested_at is not None:
        skip = "cancel already requested"
    return Plan(current=_age(job), change=change, credits=_credits(job), skip=skip)


def _cancel(job: Job, *, actor, reason: str, options: dict) -> str:
    before = job.state
    job = services.job_cancel(job_id=job.pk, reason=reason, actor=actor)
    if job.state == before:
        return "cancel requested"
    return f"{before} → {job.state}"


JOB_CANCEL = JobRunbook(
    name="cancel", title="Cancel", permission="jobs.cancel_job", permission_label="Can cancel a job",
    plan=_cancel_plan, perform=_cancel, command="cancel_job",
    description="Cancel jobs: waiting ones at once, executing ones cooperatively (the worker stops them).")

RUNBOOKS = (JOB_REQUEUE, JOB_FAIL, JOB_CANCEL)


def runbooks_register() -> None:
    """``JobsConfig.ready``: the job runbooks join the registry, in this order."""
    for runbook in RUNBOOKS:
        runbook_register(runbook)
