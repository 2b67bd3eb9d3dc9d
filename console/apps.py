from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    """The top floor: what spans the domain apps — the operations dashboard, the assembled admin
    pages (``console.admin``, loaded by the admin's autodiscovery after the apps below it),
    retention, and the commands that work across apps."""

    name = "console"
    verbose_name = "Operations console"
