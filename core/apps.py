from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "core"
    verbose_name = "Tenancy, events and audit"

    def ready(self):
        from django.db.models.signals import post_migrate

        from core.runbooks import operators_sync

        # after Django's own handlers (auth and contenttypes come first): every runbook permission
        # exists and the Operators group holds it
        post_migrate.connect(operators_sync, dispatch_uid="core-runbook-operators-sync")

        from core.tracing import tracing_start

        tracing_start()  # once per process; nothing when the OTEL_* variables leave traces off

        from core.pgtypes import timestamps_parsed_fast

        timestamps_parsed_fast()
