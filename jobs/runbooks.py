"""The job runbooks: requeue, fail or cancel a stuck job (admin actions and commands).

Each plans the change on one job and performs it through ``jobs.services``, which locks the
row, follows seed 000's transition matrix and writes the audit record. Jobs hold no credits:
the plan names the run a job works for, if any.
"""

from __future__ import annotations

from django.utils import timezone

from core.runbooks import Plan, Runbook, Skip
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


def _requeue(job: Job, *, actor, reason: str, options: dict) -> str:
    before = job.state
    job = services.job_requeue(job_id=job.pk, actor=actor, reason=reason)
    if before == job.state:
        raise Skip(f"already {job.state}")
    return f"{before} → {job.state}"


JOB_REQUEUE = Runbook(name="requeue", title="Requeue", permission="jobs.requeue_job", plan=_requeue_plan,
                      perform=_requeue)


def _fail_plan(job: Job, options: dict) -> Plan:
    return Plan(current=_age(job), change=f"{job.state} → failed ({JobReason.FATAL})", credits=_credits(job),
                skip=_ended(job))


def _fail(job: Job, *, actor, reason: str, options: dict) -> str:
    before = job.state
    job = services.job_fail(job_id=job.pk, reason=JobReason.FATAL,
                            error=f"failed by operator {actor_label(actor)}: {reason}", actor=actor,
                            audit_reason=reason)
    if before == job.state:
        raise Skip(f"already {job.state}")
    return f"{before} → {job.state}"


JOB_FAIL = Runbook(name="fail", title="Fail", permission="jobs.fail_job", plan=_fail_plan, perform=_fail)


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


JOB_CANCEL = Runbook(name="cancel", title="Cancel", permission="jobs.cancel_job", plan=_cancel_plan,
                     perform=_cancel)
