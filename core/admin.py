"""Admin for tenancy, events and audit (read-only: these change only through services;
events and audit records can never be deleted)."""

from django.contrib import admin

from core.admin_runbooks import recent_filter
from core.admin_scale import ScaledListMixin
from core.models import AuditRecord, Event, Membership, Organization, Project


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
