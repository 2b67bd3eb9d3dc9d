"""Diagnosis in the console: the run page's diagnosis panel and "Suggest next action" button,
and read-only lists of explanations and suggestions.

``RunDiagnosisAdminMixin`` goes on the run admin: its change page renders the panel (the
failed step attempts of the run, each followed by its explanation under its stable id, and
the latest suggestion, marked stale once the run changed), and ``<id>/suggest/`` takes the
button's POST (CSRF-checked, ``diagnosis.request_suggestion`` plus the view permission).
"""

from __future__ import annotations

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import reverse

from core.admin import ReadOnlyAdmin
from core.admin_runbooks import object_path, recent_filter, top_values_filter
from core.errors import DomainError
from core.runbooks import describe_error
from diagnosis.models import Explanation, Suggestion
from diagnosis.services import suggestion_request

SUGGEST_PERMISSION = "diagnosis.request_suggestion"


class RunDiagnosisAdminMixin:
    """The diagnosis panel on the run page and the URL of its "Suggest next action" button."""

    change_form_template = "admin/diagnosis/run_change_form.html"

    def has_request_suggestion_permission(self, request, obj=None) -> bool:
        return self.has_view_permission(request, obj) and request.user.has_perm(SUGGEST_PERMISSION)

    def get_urls(self):
        return [object_path(self, "suggest", self.suggest_view, "suggest"), *super().get_urls()]

    def suggest_view(self, request, object_id):
        """Ask for a suggested next action on one run (single flight: asking again returns the same job)."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        obj = self.get_object(request, unquote(object_id))
        if obj is None:
            raise Http404(f"{self.model._meta.verbose_name} {object_id} does not exist")
        if not self.has_request_suggestion_permission(request, obj):
            raise PermissionDenied
        opts = self.model._meta
        back = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[quote(obj.pk)]) + "#diagnosis"
        try:
            requested = suggestion_request(run_id=obj.pk, actor=request.user)
        except DomainError as exc:
            self.message_user(request, f"Suggest next action: refused: {describe_error(exc)}", messages.ERROR)
            return HttpResponseRedirect(back)
        if requested.dedupe == "enqueued":
            self.message_user(request, f"Suggest next action: asked (job {requested.job.pk}); the suggestion "
                                       "appears below when it is ready.", messages.SUCCESS)
        else:
            self.message_user(request, f"Suggest next action: already being worked on (job {requested.job.pk}).",
                              messages.INFO)
        return HttpResponseRedirect(back)


@admin.register(Explanation)
class ExplanationAdmin(ReadOnlyAdmin):
    list_display = ("id", "run", "step", "attempt_number", "error_code", "status", "job", "created_at",
                    "explained_at")
    list_filter = ("status", top_values_filter("error_code", "error code"), recent_filter("created_at", "failed"))
    list_select_related = ("run", "step", "job")
    search_fields = ("=run__id", "error_code", "text")
    show_full_result_count = False
    readonly_fields = ("run", "step", "step_attempt", "attempt_number", "error_code", "status", "text", "facts",
                       "engine_decision", "job", "created_at", "updated_at", "explained_at")
    fields = readonly_fields


@admin.register(Suggestion)
class SuggestionAdmin(ReadOnlyAdmin):
    list_display = ("id", "run", "status", "action", "text", "requested_by", "requested_at", "run_status",
                    "completed_at")
    list_filter = ("status", "action", recent_filter("requested_at", "requested"))
    list_select_related = ("run", "requested_by")
    search_fields = ("=run__id", "action", "text")
    show_full_result_count = False
    readonly_fields = ("run", "job", "requested_by", "requested_at", "run_status", "run_version", "status", "action",
                       "text", "facts", "completed_at")
    fields = readonly_fields
