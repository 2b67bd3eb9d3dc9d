from django.apps import AppConfig
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


def check_q_cluster(config: dict) -> None:
    """django-q2 re-delivers a message after ``retry`` seconds: it must exceed ``timeout``."""
    timeout = config.get("timeout")
    retry = config.get("retry")
    if timeout is None or retry is None or retry <= timeout:
        raise ImproperlyConfigured(
            f"Q_CLUSTER retry ({retry}) must be greater than timeout ({timeout}); otherwise a message "
            f"is delivered again while its task still runs (ORCHESTRATOR_Q_RETRY_S > ORCHESTRATOR_Q_TIMEOUT_S)")
    if timeout <= settings.ORCHESTRATOR_QUEUE_DRAIN_MAX_S:
        raise ImproperlyConfigured("Q_CLUSTER timeout must exceed ORCHESTRATOR_QUEUE_DRAIN_MAX_S")


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Job queue"

    def ready(self):
        check_q_cluster(settings.Q_CLUSTER)
        from django_q.signals import post_spawn

        from jobs import cluster_queue

        cluster_queue.install()  # a worker killed while idle must not freeze its cluster

        from core.metrics import COLLECTORS, COMPACTORS, DERIVED
        from core.planner import statistics_tables_register
        from jobs import definitions  # noqa: F401  (registers the built-in job types)
        from jobs import runbooks
        from jobs.metrics import JOB_COUNTERS, job_counters_rollup, jobs_collect
        from jobs.models import CommandRecord, Job

        statistics_tables_register(Job, churn=True)  # the claim's plans depend on how many jobs wait
        statistics_tables_register(CommandRecord)  # written by every step
        if jobs_collect not in COLLECTORS:
            COLLECTORS.append(jobs_collect)
        if JOB_COUNTERS not in DERIVED:
            DERIVED.append(JOB_COUNTERS)
        if job_counters_rollup not in COMPACTORS:
            COMPACTORS.append(job_counters_rollup)

        runbooks.runbooks_register()

        from core.bulk import bulk_launcher_register
        from jobs.tasks import bulk_runbook_send

        bulk_launcher_register(bulk_runbook_send)  # bulk runbook operations run as the bulk_runbook task
        from jobs.worker import process_started

        def start_heartbeat(sender, proc_name, **kwargs):
            process_started()

        post_spawn.connect(start_heartbeat, weak=False, dispatch_uid="orchestrator-heartbeat")
