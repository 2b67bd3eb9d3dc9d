"""What every runbook admin shares: actions, confirmation, permission, per-object report, list filters.

``RunbookAdminMixin`` offers every runbook registered for the admin's model (``core.runbooks``)
as an action on the list: it shows an intermediate page listing the selected objects with the
state change and the credits at stake and asks for a reason (and the runbook's own form
fields); once confirmed it applies the runbook object by object through
``core.runbooks.runbook_execute`` (the services write our audit records), writes Django's
admin ``LogEntry`` for each object changed and reports per object what happened. The same
action is offered as a button on the object's page (``<id>/runbook/<action>/``) where the
runbook says it shows and its plan applies.

Our model admins are read-only (no change permission), so an action requires the view
permission plus the runbook's own permission.
"""

from __future__ import annotations

from datetime import timedelta

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.options import IS_POPUP_VAR
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db import connections, router
from django.http import Http404, HttpResponseBase, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone

from core.bulk import bulk_operation_launch, bulk_operation_start
from core.errors import DomainError
from core.runbooks import (
    DONE,
    REFUSED,
    SKIPPED,
    Runbook,
    RunbookForm,
    describe_error,
    runbook_execute,
    runbook_plan,
    runbooks_for,
)

__all__ = ["RunbookAdminMixin", "RunbookForm", "recent_filter", "top_values_filter"]

# More than this: use the management command. The confirmation posts one field per object, and
# Django refuses more than DATA_UPLOAD_MAX_NUMBER_FIELDS (1,000) fields in a request.
RUNBOOK_MAX_OBJECTS = 500
REPORT_PER_OBJECT = 25  # past this many objects, the rest is summed up per result
CONFIRM_FIELD = "runbook_confirm"


def runbook_action(runbook: Runbook):
    """The admin action of ``runbook``: ``(modeladmin, request, queryset)`` → confirm, then apply and report."""

    def action(modeladmin, request, queryset):
        return modeladmin.runbook_respond(request, queryset, runbook)

    action.__name__ = runbook.name
    action.short_description = runbook.admin_action_label
    return action


class RunbookAdminMixin:
    """The registered runbooks of the admin's model as actions, with their confirmation pages,
    change-page buttons and per-object reports."""

    change_form_template = "admin/runbook_change_form.html"
    runbook_confirm_template = "admin/runbook_confirm.html"

    @property
    def runbooks(self) -> dict[str, Runbook]:
        """Action name → runbook, read from the registry (apps register theirs once they are ready)."""
        return {runbook.name: runbook for runbook in runbooks_for(self.model)}

    def has_runbook_permission(self, request, runbook: Runbook, obj=None) -> bool:
        """The view permission plus the runbook's own."""
        return self.has_view_permission(request, obj) and request.user.has_perm(runbook.permission)

    def get_actions(self, request):
        actions = super().get_actions(request)
        if self.actions is None or IS_POPUP_VAR in request.GET:
            return actions
        for name, runbook in self.runbooks.items():
            if self.has_runbook_permission(request, runbook):
                actions[name] = (runbook_action(runbook), name, runbook.admin_action_label)
        return actions

    # --- the action ------------------------------------------------------------------------
    def runbook_respond(self, request, queryset, runbook: Runbook):
        """The body of every runbook action: confirm, then apply and report."""
        objects = list(queryset.order_by("pk")[:RUNBOOK_MAX_OBJECTS + 1])
        if len(objects) > RUNBOOK_MAX_OBJECTS:
            if request.POST.get("select_across") == "1":
                return self.runbook_bulk_respond(request, queryset, runbook)
            self.message_user(request, f"{runbook.title}: select at most {RUNBOOK_MAX_OBJECTS} objects here, or "
                                       "\"select all\" to run it over the whole filter as a bulk operation. "
                                       "Nothing was changed.", messages.ERROR)
            return None
        form_class = runbook.form
        if request.method == "POST" and request.POST.get(CONFIRM_FIELD) == runbook.name:
            form = form_class(request.POST)
            if form.is_valid():
                self.runbook_apply(request, runbook, objects, reason=form.cleaned_data["reason"],
                                   options=form.runbook_options())
                return None
        else:
            form = form_class(initial=self.runbook_initial(runbook, objects))
        return self.runbook_confirm_page(request, runbook, objects, form)

    def runbook_bulk_respond(self, request, queryset, runbook: Runbook):
        """"Select all" beyond the page cap: confirm, then record a bulk operation over the list's
        filter (its query string) and process it in the background; its page shows the progress."""
        query = request.GET.urlencode()
        if request.method == "POST" and request.POST.get(CONFIRM_FIELD) == runbook.name:
            form = runbook.form(request.POST)
            if form.is_valid():
                try:
                    operation = bulk_operation_start(runbook=runbook, query=query, actor=request.user,
                                                     reason=form.cleaned_data["reason"],
                                                     options=form.runbook_options(), queryset=queryset)
                except DomainError as exc:
                    self.message_user(request, f"{runbook.title}: {describe_error(exc)}", messages.ERROR)
                    return None
                bulk_operation_launch(operation)
                self.message_user(request, f"{runbook.title}: bulk operation {operation.pk} over "
                                           f"{operation.total} objects started.", messages.SUCCESS)
                return HttpResponseRedirect(reverse("admin:core_bulkoperation_change", args=[operation.pk]))
        else:
            form = runbook.form(initial=self.runbook_initial(runbook, list(queryset.order_by("pk")[:1])))
        sample = list(queryset.order_by("pk")[:REPORT_PER_OBJECT])
        response = self.runbook_confirm_page(request, runbook, sample, form)
        response.context_data.update({"bulk_total": queryset.count(), "bulk_query": query,
                                      "title": f"{runbook.title} over the whole filter: are you sure?"})
        return response

    def runbook_initial(self, runbook: Runbook, objects: list) -> dict:
        """Initial values of the confirmation form's extra fields (the runbook's ``initial``)."""
        return runbook.initial(objects) if runbook.initial else {}

    def runbook_apply(self, request, runbook: Runbook, objects: list, *, reason: str, options: dict) -> list:
        outcomes = runbook_execute(runbook, objects, actor=request.user, reason=reason, options=options)
        for outcome in outcomes:
            if outcome.result == DONE:
                self.log_change(request, outcome.target, f"{runbook.title}: {outcome.detail}. Reason: {reason}")
        self.runbook_report(request, runbook, outcomes)
        return outcomes

    def runbook_report(self, request, runbook: Runbook, outcomes: list) -> None:
        levels = {DONE: messages.SUCCESS, SKIPPED: messages.WARNING, REFUSED: messages.ERROR}
        noun = self.model._meta.verbose_name
        for outcome in outcomes[:REPORT_PER_OBJECT]:
            self.message_user(request, f"{runbook.title} — {noun} {outcome.target.pk}: {outcome.result}: "
                                       f"{outcome.detail}", levels.get(outcome.result, messages.INFO))
        rest = outcomes[REPORT_PER_OBJECT:]
        for result in (DONE, SKIPPED, REFUSED):
            same = [outcome for outcome in rest if outcome.result == result]
            if same:
                ids = ", ".join(str(outcome.target.pk) for outcome in same)
                self.message_user(request, f"{runbook.title} — {len(same)} more {result}: {ids}", levels[result])

    def runbook_confirm_page(self, request, runbook: Runbook, objects: list, form: RunbookForm):
        opts = self.model._meta
        preview = form.runbook_options()
        rows = []
        for obj in objects:
            plan = runbook_plan(runbook, obj, preview)
            rows.append({"object": obj, "plan": plan,
                         "url": reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[quote(obj.pk)])})
        single = getattr(request, "runbook_object", None)
        back = (reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[quote(single.pk)]) if single
                else reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"))
        context = {
            **self.admin_site.each_context(request),
            "title": f"{runbook.title}: are you sure?",
            "subtitle": None,
            "opts": opts,
            "app_label": opts.app_label,
            "runbook": runbook,
            "rows": rows,
            "to_do": sum(1 for row in rows if row["plan"].applies),
            "to_refuse": sum(1 for row in rows if row["plan"].refusal and not row["plan"].skip),
            "to_skip": sum(1 for row in rows if row["plan"].skip),
            "form": form,
            "media": self.media + form.media,
            "action_name": runbook.name,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "confirm_field": CONFIRM_FIELD,
            "back_url": back,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.runbook_confirm_template, context)

    # --- the per-object buttons ---------------------------------------------------------------
    def get_urls(self):
        return [object_path(self, "runbook/<str:action>", self.runbook_object_view, "runbook"), *super().get_urls()]

    def runbook_object_view(self, request, object_id, action):
        """One runbook action on one object: the same action function, its confirmation and report."""
        obj = self.get_object(request, unquote(object_id))
        if obj is None:
            raise Http404(f"{self.model._meta.verbose_name} {object_id} does not exist")
        actions = self.get_actions(request)
        if action not in self.runbooks or action not in actions:
            raise PermissionDenied
        request.runbook_object = obj
        function = actions[action][0]
        response = function(self, request, self.get_queryset(request).filter(pk=obj.pk))
        if isinstance(response, HttpResponseBase):
            return response
        opts = self.model._meta
        return HttpResponseRedirect(reverse(f"admin:{opts.app_label}_{opts.model_name}_change",
                                            args=[quote(obj.pk)]))

    def runbook_buttons(self, request, obj) -> list[dict]:
        """The runbook actions this user may take on ``obj`` that apply to its current state."""
        if obj is None:
            return []
        actions = self.get_actions(request)
        opts = self.model._meta
        buttons = []
        for name, runbook in self.runbooks.items():
            if name not in actions or not runbook.button_shows_on(obj):
                continue
            options = runbook.form(initial=self.runbook_initial(runbook, [obj])).runbook_options()
            plan = runbook_plan(runbook, obj, options)
            if not plan.applies:
                continue
            buttons.append({"name": name, "title": runbook.title, "change": plan.change,
                            "url": reverse(f"admin:{opts.app_label}_{opts.model_name}_runbook",
                                           args=[quote(obj.pk), name])})
        return buttons

    def change_view(self, request, object_id, form_url="", extra_context=None):
        obj = self.get_object(request, unquote(object_id))
        extra_context = {**(extra_context or {}), "runbook_buttons": self.runbook_buttons(request, obj)}
        return super().change_view(request, object_id, form_url, extra_context)


# --- list filters an incident needs ---------------------------------------------------------

RECENT_WINDOWS = {"15m": timedelta(minutes=15), "1h": timedelta(hours=1), "24h": timedelta(hours=24),
                  "7d": timedelta(days=7)}
RECENT_LABELS = {"15m": "Last 15 minutes", "1h": "Last hour", "24h": "Last 24 hours", "7d": "Last 7 days"}


def object_path(model_admin, route: str, view, name: str):
    """A page of one object of ``model_admin`` at ``<object_id>/<route>/``, behind the admin's login
    and named ``<app>_<model>_<name>`` (``reverse("admin:runs_run_sidecar", args=[run.pk])``)."""
    opts = model_admin.model._meta
    return path(f"<path:object_id>/{route}/", model_admin.admin_site.admin_view(view),
                name=f"{opts.app_label}_{opts.model_name}_{name}")


def recent_filter(field: str, title: str):
    """A list filter: ``field`` within the last 15 minutes, hour, day or week."""

    class RecentFilter(admin.SimpleListFilter):
        parameter_name = f"{field}_within"

        def lookups(self, request, model_admin):
            return list(RECENT_LABELS.items())

        def queryset(self, request, queryset):
            window = RECENT_WINDOWS.get(self.value() or "")
            if window is None:
                return queryset
            return queryset.filter(**{f"{field}__gte": timezone.now() - window})

    RecentFilter.title = title
    RecentFilter.__name__ = f"Recent{field.title().replace('_', '')}Filter"
    return RecentFilter


def top_values_filter(field: str, title: str, *, limit: int = 20, sample: int = 5_000, parameter: str = ""):
    """A list filter over the ``limit`` most frequent non-empty values of ``field`` (error codes ...)
    among the latest ``sample`` rows, each with its count there: the choices cost the same on a
    table of a thousand rows or of millions. Any other value can still be given in the URL
    (``?<parameter>=``, the field's name unless ``parameter`` says otherwise)."""

    class TopValuesFilter(admin.SimpleListFilter):
        parameter_name = parameter or field

        def lookups(self, request, model_admin):
            model = model_admin.model
            connection = connections[router.db_for_read(model)]
            qn = connection.ops.quote_name
            column, pk = qn(model._meta.get_field(field).column), qn(model._meta.pk.column)
            with connection.cursor() as cursor:
                cursor.execute(f"SELECT value, COUNT(*) AS n FROM (SELECT {column} AS value FROM "
                               f"{qn(model._meta.db_table)} ORDER BY {pk} DESC LIMIT %s) AS latest "
                               "WHERE value <> '' GROUP BY value ORDER BY n DESC, value LIMIT %s", [sample, limit])
                rows = cursor.fetchall()
            choices = [(value, f"{value} ({n})") for value, n in rows]
            if self.value() and self.value() not in {value for value, _ in choices}:
                choices.append((self.value(), self.value()))
            return choices

        def queryset(self, request, queryset):
            if self.value():
                return queryset.filter(**{field: self.value()})
            return queryset

    TopValuesFilter.title = title
    TopValuesFilter.__name__ = f"Top{field.title().replace('_', '')}Filter"
    return TopValuesFilter
