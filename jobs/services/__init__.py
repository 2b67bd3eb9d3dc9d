"""The only writers of jobs: enqueue, claim, complete, fail, cancel, recover.

Every service locks the job row before changing it and moves the state only through the
FSM transitions of ``jobs.models.Job`` (seed 000's matrix). A result or failure reported for
an attempt that is no longer current (the job was cancelled, recovered or finished meanwhile)
is discarded, never applied. django-q2 messages are sent only after commit.

By concern:
- ``common``: the job's API form, the move that writes a transition (FSM check, timestamps,
  transition log, event), the row lock, the definition hooks run after commit, the wake-up;
  ``job_transition``.
- ``enqueue``: ``job_enqueue`` with its caps on waiting jobs and dedupe; ``jobs_enqueue_many``
  (several of one type in one transaction, written in bulk).
- ``claim``: ``jobs_claim`` (a batch in one statement, its SQL in ``claim_sql``, built once per
  process), ``job_claim``, ``jobs_eligible``, ``jobs_claim_order``, lanes and concurrency slots.
- ``outcomes``: ``job_progress``, ``job_complete``, ``jobs_complete`` (several in one statement),
  ``job_fail_attempt`` (the retry decision), ``job_fail``, ``job_retarget`` (an executing attempt
  moves on to new work), ``jobs_renew_leases`` (the claimed jobs a worker has not started yet).
- ``cancellation``: ``job_cancel``, ``job_mark_cancelled``, ``job_cancel_requested``,
  ``jobs_enforce_interrupt_timeouts``.
- ``pauses``: ``queue_pause``, ``queue_resume`` (the claim passes over a paused queue's jobs).
- ``recovery``: ``job_requeue``, ``job_renew_lease``, ``jobs_recover_expired``, ``jobs_enforce_deadlines``.
"""

from jobs.services.cancellation import (
    job_cancel,
    job_cancel_requested,
    job_mark_cancelled,
    jobs_enforce_interrupt_timeouts,
)
from jobs.services.claim import (claim_warm, job_claim, jobs_claim, jobs_claim_order, jobs_eligible,
                                 organization_max_executing)
from jobs.services.common import job_as_dict, job_transition
from jobs.services.enqueue import EnqueueResult, job_enqueue, jobs_enqueue_many, organization_max_waiting
from jobs.services.outcomes import (
    job_complete,
    job_fail,
    job_fail_attempt,
    job_progress,
    job_retarget,
    jobs_complete,
    jobs_renew_leases,
)
from jobs.services.pauses import queue_pause, queue_resume
from jobs.services.recovery import job_renew_lease, job_requeue, jobs_enforce_deadlines, jobs_recover_expired

__all__ = [
    "EnqueueResult",
    "job_as_dict",
    "job_cancel",
    "job_cancel_requested",
    "claim_warm",
    "job_claim",
    "job_complete",
    "job_enqueue",
    "job_fail",
    "job_fail_attempt",
    "job_mark_cancelled",
    "job_progress",
    "job_renew_lease",
    "job_requeue",
    "job_retarget",
    "job_transition",
    "jobs_claim",
    "jobs_claim_order",
    "jobs_complete",
    "jobs_eligible",
    "jobs_enforce_deadlines",
    "jobs_enqueue_many",
    "jobs_enforce_interrupt_timeouts",
    "jobs_recover_expired",
    "jobs_renew_leases",
    "organization_max_executing",
    "organization_max_waiting",
    "queue_pause",
    "queue_resume",
]
