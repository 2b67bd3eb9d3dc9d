"""The job runbooks: requeue, fail or cancel a stuck job, registered by ``JobsConfig.ready``.

Each plans the change on one job and performs it through ``jobs.services``, which locks the
row, follows seed 000's transition matrix and writes the audit record; its declaration also
gives the admin action and button, the permission and the command (``core.runbooks``). Jobs
hold no credits: the plan names the run a job works for, if any.
"""

from __future__ import annotations

from functools import partial

from django.core.management.base import CommandError
from django.utils import timezone

from core.errors import ValidationFailed
from core.management.base import positive_id, runbook_command
from core.models import Project
from core.runbooks import Plan, Runbook, Skip, by_id, runbook_register, transition
from core.services import actor_label
from jobs import services
from jobs.errors import QueuePauseConflict
from jobs.models import TERMINAL_JOB_STATES, WAITING_JOB_STATES, Job, JobReason, JobState, QueuePause
from jobs.registry import definition_get


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

# --- pausing and resuming a queue ---------------------------------------------------------------

class JobTypeQueue:
    """The queue of every job of one type: a runbook target beside a project (``pause_queue --job-type``)."""

    project_id = None

    def __init__(self, job_type: str) -> None:
        if definition_get(job_type) is None:
            raise ValidationFailed("unknown job type", errors={"job_type": [f"{job_type!r} is not a registered "
                                                                            "job type"]})
        self.pk = self.job_type = job_type

    def __str__(self) -> str:
        return f"job type {self.job_type}"


def _queue_of(target) -> dict:
    if isinstance(target, JobTypeQueue):
        return {"job_type": target.job_type}
    return {"project_id": target.pk}


def _pause_of(target) -> QueuePause | None:
    if isinstance(target, JobTypeQueue):
        return QueuePause.objects.filter(job_type=target.job_type).first()
    return QueuePause.objects.filter(project_id=target.pk).first()


def _waiting(target) -> str:
    jobs = Job.objects.filter(state__in=list(WAITING_JOB_STATES), **(
        {"type": target.job_type} if isinstance(target, JobTypeQueue) else {"project_id": target.pk}))
    return f"{jobs.count()} jobs waiting"


def _paused_since(pause: QueuePause) -> str:
    return f"paused by {pause.actor_label} since {pause.since:%Y-%m-%d %H:%M:%S} ({pause.reason})"


def _pause_plan(target, options: dict) -> Plan:
    pause = _pause_of(target)
    current = _paused_since(pause) if pause else f"claimed ({_waiting(target)})"
    return Plan(current=current, change="queue → paused (its jobs stay queued, nothing is claimed)",
                credits="no credits move", skip="already " + _paused_since(pause) if pause else "")


def _resume_plan(target, options: dict) -> Plan:
    pause = _pause_of(target)
    return Plan(current=_paused_since(pause) if pause else "not paused",
                change=f"queue → claimed again in order ({_waiting(target)})", credits="no credits move",
                skip="" if pause else "not paused")


def _queue_change(service, done: str):
    def perform(target, *, actor, reason: str, options: dict) -> str:
        try:
            service(**_queue_of(target), actor=actor, reason=reason)
        except QueuePauseConflict as exc:
            raise Skip(exc.detail) from None
        return done

    return perform


QueueRunbook = partial(Runbook, model=Project, noun="project", permission="jobs.pause_queue",
                       permission_label="Can pause and resume a queue", permission_model=QueuePause, button=True)


def _queue_runbook(verb: str, service, *, plan, done: str, description: str) -> Runbook:
    """``<verb>_queue`` (its runbook, admin action, button and command) over ``service``."""
    return QueueRunbook(name=f"{verb}_queue", title=f"{verb.capitalize()} queue", plan=plan,
                        perform=_queue_change(service, done), command=f"{verb}_queue",
                        action_label=f"{verb.capitalize()} the queues of selected projects…", description=description)


QUEUE_PAUSE = _queue_runbook(
    "pause", services.queue_pause, plan=_pause_plan, done="queue paused: its jobs stay queued",
    description="Pause a project's queue (or a job type's, --job-type): its jobs stay queued, none is claimed, "
                "its runs wait; enqueueing goes on.")
QUEUE_RESUME = _queue_runbook(
    "resume", services.queue_resume, plan=_resume_plan, done="queue resumed: its jobs are claimed in order",
    description="Resume a paused queue (a project's, or a job type's with --job-type): its jobs are claimed again, "
                "in order.")


def queue_command(command: str):
    """The ``Command`` of a queue runbook: ``--project ID`` or ``--job-type TYPE`` names the queue."""
    base = runbook_command(command)

    class Command(base):
        def add_target_arguments(self, parser) -> None:
            queue = parser.add_mutually_exclusive_group(required=True)
            queue.add_argument("--project", type=positive_id, metavar="ID", help="the project whose queue it is")
            queue.add_argument("--job-type", metavar="TYPE", help="the job type whose queue it is (every project's)")

        def targets(self, options, runbook_options: dict) -> list:
            if options["job_type"] is not None:
                self.noun = "job type"
                return [JobTypeQueue(options["job_type"])]
            project = Project.objects.filter(pk=options["project"]).first()
            if project is None:
                raise CommandError(f"project {options['project']} does not exist")
            return [project]

    Command.noun = "project"
    Command.__doc__ = base.__doc__
    return Command


RUNBOOKS = (JOB_REQUEUE, JOB_FAIL, JOB_CANCEL, QUEUE_PAUSE, QUEUE_RESUME)


def runbooks_register() -> None:
    """``JobsConfig.ready``: the job runbooks join the registry, in this order."""
    for runbook in RUNBOOKS:
        runbook_register(runbook)
