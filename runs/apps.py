from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"
    verbose_name = "Runs"

    def ready(self):
        from core.metrics import COLLECTORS, DERIVED
        from core.planner import statistics_tables_register
        from core.scopes import event_scope_register
        from jobs.worker import HEARTBEAT_HOOKS, MAINTENANCE_HOOKS
        from runs import escalation_runbooks, execution, runbooks, services, tools  # noqa: F401  (tools: registers the built-in tools)
        from runs.metrics import RUNS_FINISHED, runs_collect
        from runs.models import Agent, Run, RunAttempt, Step, StepAttempt, Task
        from runs.reaper import run_heartbeat_hook, runs_reap

        statistics_tables_register(Run, RunAttempt, Agent, Task, Step, StepAttempt)  # read and moved by every step
        runbooks.runbooks_register()
        escalation_runbooks.runbooks_register()
        event_scope_register(
            "run", lambda pk: Run.objects.filter(pk=pk).values_list("organization_id", flat=True).first())

        if execution.run_dispatch_locked not in services.RUN_DISPATCHERS:
            services.RUN_DISPATCHERS.append(execution.run_dispatch_locked)
        if runs_reap not in MAINTENANCE_HOOKS:
            MAINTENANCE_HOOKS.append(runs_reap)
        if run_heartbeat_hook not in HEARTBEAT_HOOKS:
            HEARTBEAT_HOOKS.append(run_heartbeat_hook)
        if runs_collect not in COLLECTORS:
            COLLECTORS.append(runs_collect)
        if RUNS_FINISHED not in DERIVED:
            DERIVED.append(RUNS_FINISHED)
