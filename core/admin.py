"""Admin for tenancy, events and audit (read-only: these change only through services;
events and audit records can never be deleted)."""

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponseNotAllowed, HttpResponseRedirect, JsonResponse
from django.urls import path, reverse

from core.admin_runbooks import recent_filter
from core.admin_scale import ScaledListMixin
from core.bulk import bulk_operation_abort, bulk_operation_as_dict
from core.errors import DomainError
from core.models import AuditRecord, BulkOperation, Event, Membership, Organization, Project
from core.runbooks import RUNBOOKS, describe_error


class ReadOnlyPermissions:
    """No one adds, changes or deletes these rows from the admin: services do."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class ReadOnlyAdmin(ReadOnlyPermissions, admin.ModelAdmin):
    """Lists and shows rows; adding, changing and deleting go through services only."""


class ReadOnlyInline(ReadOnlyPermissions, admin.TabularInline):
    extra = 0
    can_delete = False
    show_change_link = True


class MembershipInline(ReadOnlyInline):
    model = Membership
    fields = ("user", "role", "created_at")
    readonly_fields = fields


@admin.register(Organization)
class OrganizationAdmin(ReadOnlyAdmin):
    list_display = ("id", "name", "created_at")
    search_fields = ("name",)
    inlines = [MembershipInline]


@admin.register(Project)
class ProjectAdmin(ReadOnlyAdmin):
    list_display = ("id", "name", "organization", "created_at")
    list_filter = ("organization",)
    list_select_related = ("organization",)
    search_fields = ("name", "organization__name")


@admin.register(Membership)
class MembershipAdmin(ReadOnlyAdmin):
    list_display = ("id", "user", "organization", "role", "created_at")
    list_filter = ("role", "organization")
    list_select_related = ("user", "organization")
    search_fields = ("user__username", "organization__name")


@admin.register(Event)
class EventAdmin(ScaledListMixin, ReadOnlyAdmin):
    list_display = ("id", "type", "organization", "project", "run_id", "created_at")
    list_filter = ("type", "organization", recent_filter("created_at", "written"),
                   ("created_at", admin.DateFieldListFilter))
    list_select_related = ("organization", "project", "project__organization")
    search_fields = ("type", "=run_id")
    ordering = ("-id",)  # newest first, read by keyset


@admin.register(AuditRecord)
class AuditRecordAdmin(ScaledListMixin, ReadOnlyAdmin):
    list_display = ("id", "created_at", "actor_label", "action", "target_type", "target_id", "reason")
    list_filter = ("action", "target_type", "organization", recent_filter("created_at", "recorded"),
                   ("created_at", admin.DateFieldListFilter))
    list_select_related = ("organization",)
    search_fields = ("actor_label", "action", "=target_id", "=run_id", "reason")
    show_full_result_count = False


@admin.register(BulkOperation)
class BulkOperationAdmin(ReadOnlyAdmin):
    """Runbooks applied over a whole filter: progress (live on the page) and an Abort button."""

    list_display = ("id", "runbook", "actor_label", "status", "total", "done", "skipped", "refused", "started_at",
                    "finished_at")
    list_filter = ("status", "runbook", recent_filter("started_at", "started"))
    search_fields = ("=id", "actor_label", "runbook", "reason")
    change_form_template = "admin/core/bulkoperation/change_form.html"

    def get_urls(self):
        view = self.admin_site.admin_view
        return [path("<int:object_id>/progress/", view(self.progress_view), name="core_bulkoperation_progress"),
                path("<int:object_id>/abort/", view(self.abort_view), name="core_bulkoperation_abort"),
                *super().get_urls()]

    def _operation(self, request, object_id) -> BulkOperation:
        operation = self.get_object(request, str(object_id))
        if operation is None:
            raise Http404(f"bulk operation {object_id} does not exist")
        if not self.has_view_permission(request, operation):
            raise PermissionDenied
        return operation

    def may_abort(self, request, operation: BulkOperation) -> bool:
        runbook = RUNBOOKS.get(operation.runbook)
        return operation.status == BulkOperation.Status.RUNNING and (
            request.user.has_perm(runbook.permission) if runbook else request.user.is_superuser)

    def progress_view(self, request, object_id):
        """The operation's progress as JSON (the page polls it)."""
        return JsonResponse(bulk_operation_as_dict(self._operation(request, object_id)))

    def abort_view(self, request, object_id):
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        operation = self._operation(request, object_id)
        if not self.may_abort(request, operation):
            raise PermissionDenied
        try:
            bulk_operation_abort(operation_id=operation.pk, actor=request.user)
        except DomainError as exc:
            self.message_user(request, describe_error(exc), messages.ERROR)
        else:
            self.message_user(request, f"Bulk operation {operation.pk}: abort requested; it stops after the batch "
                                       "in progress.", messages.WARNING)
        return HttpResponseRedirect(reverse("admin:core_bulkoperation_change", args=[operation.pk]))

    def change_view(self, request, object_id, form_url="", extra_context=None):
        operation = self.get_object(request, object_id)
        extra = {"bulk_may_abort": operation is not None and self.may_abort(request, operation)}
        return super().change_view(request, object_id, form_url, {**(extra_context or {}), **extra})
