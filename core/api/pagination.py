"""Pagination: pages for small lists, an id cursor for the large collections and for events.

* ``PagePagination`` — ``?page=N&page_size=M``: ``{"count", "next", "previous", "results"}``
  with an exact count. For lists that stay small (organizations, projects, escalations).
* ``KeysetPagination`` — the large collections (runs, jobs, ledger entries): newest first, a
  page is read by seeking past the previous page's last id (``?cursor=``, opaque), so a deep page
  costs what the first one does and no request counts the whole table. ``count`` is exact up to
  ``ORCHESTRATOR_API_COUNT_LIMIT`` (1,000) matching rows and ``null`` beyond; a first page that
  holds every matching row is its own count (no count query). A request that names
  ``?page=`` still gets the page-number answer (exact count, ``?page=N`` links) for clients
  written against it; that form costs a full count and an OFFSET and is kept for compatibility.
"""

from __future__ import annotations

from django.conf import settings
from rest_framework.pagination import CursorPagination, PageNumberPagination
from rest_framework.response import Response


class PagePagination(PageNumberPagination):
    """``?page=N&page_size=M`` (at most 200): ``{"count", "next", "previous", "results"}``."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 200


def bounded_count(queryset, limit: int) -> int | None:
    """The number of rows of ``queryset`` if at most ``limit``, else ``None``; reads at most
    ``limit + 1`` rows (``SELECT count(*) FROM (SELECT ... LIMIT limit + 1)``)."""
    found = queryset.order_by().values("pk")[:limit + 1].count()
    return found if found <= limit else None


class KeysetPagination(CursorPagination):
    """Newest first by id, ``?cursor=`` to read on (``next``/``previous`` carry it), ``?page_size=``
    (at most 200); ``?page=N`` answers as ``PagePagination`` does. See the module docstring."""

    ordering = "-id"
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 200
    page_query_param = "page"

    def paginate_queryset(self, queryset, request, view=None):
        self.legacy = None
        if self.page_query_param in request.query_params:
            self.legacy = PagePagination()
            return self.legacy.paginate_queryset(queryset, request, view)
        page = super().paginate_queryset(queryset, request, view)
        if self.cursor is None and not self.has_next and page is not None:
            self.count = len(page)  # the first page holds them all: no count query
        else:
            self.count = bounded_count(queryset, settings.ORCHESTRATOR_API_COUNT_LIMIT)
        return page

    def get_paginated_response(self, data):
        if self.legacy is not None:
            return self.legacy.get_paginated_response(data)
        return Response({"count": self.count, "next": self.get_next_link(), "previous": self.get_previous_link(),
                         "results": data})

    def get_paginated_response_schema(self, schema):
        described = super().get_paginated_response_schema(schema)
        for link in ("next", "previous"):  # DRF's own examples end in a stray quote (not a URI)
            described["properties"][link]["example"] = "https://console.example.org/api/v1/runs/?cursor=cD00ODY%3D"
        described["properties"] = {
            "count": {"type": "integer", "nullable": True,
                      "description": ("matching rows, exact up to ORCHESTRATOR_API_COUNT_LIMIT (1,000 "
                                     "by default since API 1.1; 10,000 before); null beyond")},
            **described["properties"]}
        return described

    def get_schema_operation_parameters(self, view):
        return [*super().get_schema_operation_parameters(view), {
            "name": self.page_query_param, "required": False, "in": "query",
            "description": "page number (the older page-number form: exact count, OFFSET)",
            "schema": {"type": "integer"}}]
