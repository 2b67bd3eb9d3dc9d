"""The assembled admin pages: the run page of ``runs`` with the diagnosis panel of ``diagnosis``.

``runs`` knows nothing of ``diagnosis``; the console, above both, registers the run admin again
with the diagnosis panel and its "Suggest next action" button mixed in.
"""

from __future__ import annotations

from django.contrib import admin

from diagnosis.admin import RunDiagnosisAdminMixin
from runs.admin import RunAdmin
from runs.models import Run


class ConsoleRunAdmin(RunDiagnosisAdminMixin, RunAdmin):
    """The run page operators see: status, tree, ledger, runbooks, pipeline and diagnosis."""


if admin.site.is_registered(Run):
    admin.site.unregister(Run)
admin.site.register(Run, ConsoleRunAdmin)
