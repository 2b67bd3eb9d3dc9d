from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "core"
    verbose_name = "Tenancy, events and audit"

    def ready(self):
        from core.tracing import tracing_start

        tracing_start()  # once per process; nothing when the OTEL_* variables leave traces off
