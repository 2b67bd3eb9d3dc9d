from django.apps import AppConfig


class DiagnosisConfig(AppConfig):
    name = "diagnosis"
    verbose_name = "Diagnosis"

    def ready(self):
        from diagnosis import definitions  # noqa: F401  (registers failure_explain and suggest_action)
        from diagnosis.services import explanation_request_quietly, explanations_backfill
        from jobs.worker import MAINTENANCE_HOOKS
        from runs import services

        if explanation_request_quietly not in services.STEP_FAILURE_HOOKS:
            services.STEP_FAILURE_HOOKS.append(explanation_request_quietly)
        if explanations_backfill not in MAINTENANCE_HOOKS:  # what a hook lost to a dead process
            MAINTENANCE_HOOKS.append(explanations_backfill)
