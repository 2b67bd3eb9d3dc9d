"""Changelists that stay fast on large tables: estimated counts and keyset pages.

``ScaledListMixin`` (on the run, job, ledger, event and audit lists) changes three things:

* **Counts.** The unfiltered list shows the planner's estimate on PostgreSQL
  (``pg_class.reltuples``) as "about N"; a filtered list counts at most
  ``ORCHESTRATOR_ADMIN_COUNT_LIMIT`` + 1 rows (``SELECT count(*) FROM (SELECT ... LIMIT n)``)
  and shows "10,000+" beyond. A small table is always counted exactly. A filter whose condition
  is an OR of several index ranges (the runs' "stuck") gives the admin's ``list_count_parts``
  its disjoint parts: they are counted together up to the same bound, each along its index
  (``core.sql.union_count``), not as one OR that the planner reads as a bitmap of them all.
* **Page numbers** stop at ``ORCHESTRATOR_ADMIN_MAX_PAGES`` (a larger ``?p=`` is an invalid
  page, as a page past the end always was), so no page reads a deep OFFSET; a page past the
  first skips rows by their ids alone, then reads its own rows.
* **Older pages by keyset.** When the list is in its default order (newest first), every page
  links "older →" to ``?cursor=<last id shown>``: that page is read with ``WHERE id < cursor
  ORDER BY id DESC LIMIT n``, an index seek whatever its depth. A list sorted by a column
  (``?o=``) has no cursor: it pages by number up to the cap.

A page shows 50 rows (``?rows=100`` or ``200`` for more, kept in the list's links). Its
rows are drawn by ``core.admin_rows`` (the stock HTML at a fraction of the cost), through the
``admin/scaled_change_list.html`` template.
"""

from __future__ import annotations

from django.conf import settings
from django.contrib.admin import helpers
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ORDER_VAR, PAGE_VAR, ChangeList
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import QuerySet
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.translation import gettext

from core.sql import subqueries_row, union_count

CURSOR_VAR = "cursor"
PER_PAGE_VAR = "rows"  # not "per_page": a link that drops "p" (the page) drops every key starting with it
PER_PAGE_CHOICES = (50, 100, 200)
KEYSET_ORDERINGS = (["-id"], ["-pk"], ("-id",), ("-pk",))


def estimate_or_count(queryset, limit: int) -> tuple[int, bool] | None:
    """On PostgreSQL, in one query: the planner's row estimate of ``queryset``'s table when it is
    above ``limit`` (``True``: an estimate), else the number of rows counted up to ``limit`` + 1
    (``False``); the count runs only when the estimate is small. None on another engine."""
    connection = connections[queryset.db]
    if connection.vendor != "postgresql":
        return None
    sql, params = queryset.order_by().values("pk")[:limit + 1].query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT CASE WHEN reltuples > %s THEN reltuples::bigint "
                       f"ELSE (SELECT COUNT(*) FROM ({sql}) AS bounded) END, reltuples > %s "
                       f"FROM pg_class WHERE oid = to_regclass(%s)", [limit, *params, limit, queryset.model._meta.db_table])
        row = cursor.fetchone()
    return (int(row[0]), bool(row[1])) if row else None


def counts_bounded(querysets: dict, limit: int) -> dict:
    """Each queryset's rows counted up to ``limit`` + 1 (a figure above ``limit`` means "more than
    ``limit``"), all in one query: ``SELECT (SELECT COUNT(*) FROM (... LIMIT n)), ...``. Each count
    stops after ``limit`` + 1 rows, so its cost does not follow the table's size. A queryset given
    an explicit ``order_by`` keeps it: the order of the index meant to be walked (under a limit the
    planner may otherwise walk a broader index and filter it, trusting an estimate)."""
    counts = subqueries_row(querysets, wrap="(SELECT COUNT(*) FROM ({}) AS bounded)", limit=limit + 1)
    return {name: int(count) for name, count in counts.items()}


class ScaledPaginator(Paginator):
    """A paginator whose ``count`` is cheap: see the module docstring. ``count_kind`` says what the
    number is ("exact", "estimate" or "at_least") and ``count_label`` how to show it."""

    count_parts = None  # disjoint querysets whose rows together are the list's (see the module docstring)

    def __init__(self, object_list, per_page, orphans=0, allow_empty_first_page=True):
        super().__init__(object_list, per_page, orphans, allow_empty_first_page)
        self.count_kind = "exact"

    @cached_property
    def count(self):
        queryset = self.object_list
        limit = settings.ORCHESTRATOR_ADMIN_COUNT_LIMIT
        if self.count_parts is not None:
            found = union_count(self.count_parts, limit=limit + 1)
            if found > limit:
                self.count_kind = "at_least"
            return found
        answer = None if queryset.query.has_filters() else estimate_or_count(queryset, limit)
        if answer is not None and answer[1]:
            self.count_kind = "estimate"
            return answer[0]
        found = answer[0] if answer is not None else queryset.order_by().values("pk")[:limit + 1].count()
        if found > limit:
            self.count_kind = "at_least"
        return found

    def page(self, number):
        """A page past the first reads its rows' ids first (the OFFSET walks ids alone, not the
        joins and annotations of every skipped row), then those rows, in the list's order."""
        number = self.validate_number(number)
        bottom = (number - 1) * self.per_page
        if bottom == 0 or not isinstance(self.object_list, QuerySet):
            return super().page(number)
        top = bottom + self.per_page
        if top + self.orphans >= self.count:
            top = self.count
        ids = list(self.object_list.values_list("pk", flat=True)[bottom:top])
        return self._get_page(self.object_list.filter(pk__in=ids), number, self)

    @cached_property
    def num_pages(self):
        return min(super().num_pages, max(1, settings.ORCHESTRATOR_ADMIN_MAX_PAGES))

    @property
    def count_label(self) -> str:
        count = self.count
        if self.count_kind == "estimate":
            return f"about {count:,}"
        if self.count_kind == "at_least":
            return f"{settings.ORCHESTRATOR_ADMIN_COUNT_LIMIT:,}+"
        return f"{count:,}"


class ScaledChangeList(ChangeList):
    """Keyset pages for the default ordering; see the module docstring."""

    keyset_cursor = None
    keyset_older_url = ""
    keyset_newest_url = ""

    def __init__(self, request, *args, **kwargs):
        raw = request.GET.get(CURSOR_VAR)
        if raw is not None:
            if not raw.isdigit() or not 0 < int(raw) < 2**63:
                raise IncorrectLookupParameters(f"{CURSOR_VAR} must be a row id")
            self.keyset_cursor = int(raw)
        super().__init__(request, *args, **kwargs)
        # Filter, search and sorting links start again from the newest rows.
        self.params.pop(CURSOR_VAR, None)
        getattr(self, "filter_params", {}).pop(CURSOR_VAR, None)
        if self.keyset_cursor is not None:
            self.keyset_newest_url = self.get_query_string(remove=[CURSOR_VAR, PAGE_VAR])

    def get_filters(self, request):
        # The list filters are built once per list (their choices may be read from the tables): a
        # list counted by parts asks for its queryset again, without one of them.
        if getattr(self, "_filters", None) is None:
            self._filters = super().get_filters(request)
        return self._filters

    def get_queryset(self, request, exclude_parameters=None):
        queryset = super().get_queryset(request, exclude_parameters)
        defer = getattr(self.model_admin, "list_defer", ())
        return queryset.defer(*defer) if defer else queryset

    def get_filters_params(self, params=None):
        lookup_params = super().get_filters_params(params)
        lookup_params.pop(CURSOR_VAR, None)
        lookup_params.pop(PER_PAGE_VAR, None)
        return lookup_params

    def _apply_per_page(self, request) -> None:
        """``?rows=`` (one of ``PER_PAGE_CHOICES``) shows more rows than the list's default;
        it stays in every link of the list (filters, sorting, older pages)."""
        raw = request.GET.get(PER_PAGE_VAR)
        if raw is None:
            return
        if not raw.isdigit() or int(raw) not in PER_PAGE_CHOICES:
            raise IncorrectLookupParameters(f"{PER_PAGE_VAR} must be one of {PER_PAGE_CHOICES}")
        self.list_per_page = int(raw)

    @property
    def per_page_links(self) -> list[tuple[int, str, bool]]:
        """(rows, link, shown now) for each page size offered, from the newest rows."""
        sizes = sorted({self.model_admin.list_per_page, *PER_PAGE_CHOICES})
        return [(size, self.get_query_string({PER_PAGE_VAR: size}, remove=[CURSOR_VAR, PAGE_VAR]),
                 size == self.list_per_page) for size in sizes]

    @property
    def keyset_ready(self) -> bool:
        return ORDER_VAR not in self.params and self._get_default_ordering() in KEYSET_ORDERINGS

    def get_results(self, request):
        self._apply_per_page(request)
        # Read by the admin's get_paginator (Django's get_results makes the paginator itself).
        request.scaled_list_count_parts = self.model_admin.list_count_parts(request, self)
        if self.keyset_cursor is not None and not self.keyset_ready:
            raise IncorrectLookupParameters(f"{CURSOR_VAR} pages only the default ordering")
        if self.keyset_cursor is None:
            super().get_results(request)
            if self.keyset_ready and self.multi_page and not self.show_all:
                self.result_list = list(self.result_list)
                self._link_older(len(self.result_list) >= self.list_per_page)
            return
        paginator = self.model_admin.get_paginator(request, self.queryset, self.list_per_page)
        rows = list(self.queryset.filter(pk__lt=self.keyset_cursor)[:self.list_per_page + 1])
        self.result_list = rows[:self.list_per_page]
        self.result_count = paginator.count
        self.show_full_result_count = False
        self.show_admin_actions = True
        self.full_result_count = None
        self.can_show_all = False
        self.multi_page = True
        self.paginator = paginator
        self._link_older(len(rows) > self.list_per_page)

    def _link_older(self, more: bool) -> None:
        if more and self.result_list:
            last = self.result_list[-1].pk
            self.keyset_older_url = self.get_query_string({CURSOR_VAR: last}, remove=[PAGE_VAR])


class ScaledListMixin:
    """A ModelAdmin mixin: ``ScaledPaginator`` and ``ScaledChangeList`` (see the module docstring)."""

    show_full_result_count = False
    paginator = ScaledPaginator
    # 50 rows, not Django's 100: an incident is read from the top, 50 one-line rows are two screens
    # at 1,280 px, and the rows are most of what the page costs. ``?rows=100|200`` shows more.
    list_per_page = 50
    change_list_template = "admin/scaled_change_list.html"  # rows drawn by core.admin_rows
    list_defer: tuple[str, ...] = ()  # large columns the list does not show (a run's plan)

    def get_changelist(self, request, **kwargs):
        return ScaledChangeList

    def get_paginator(self, request, queryset, per_page, orphans=0, allow_empty_first_page=True):
        paginator = super().get_paginator(request, queryset, per_page, orphans, allow_empty_first_page)
        paginator.count_parts = getattr(request, "scaled_list_count_parts", None)
        return paginator

    def list_count_parts(self, request, changelist):
        """Disjoint querysets whose rows together are the list's, for its bounded count, when one
        plain count would read more than the rows it counts (None: count the list's queryset)."""
        return None

    def action_checkbox(self, obj):
        """The stock row checkbox, written directly: rendering a form widget's template for each
        of a hundred rows is about a third of the list's time."""
        return format_html('<input type="checkbox" name="{}" value="{}" class="action-select" aria-label="{}">',
                           helpers.ACTION_CHECKBOX_NAME, str(obj.pk),
                           format_html(gettext("Select this object for an action - {}"), str(obj)))
