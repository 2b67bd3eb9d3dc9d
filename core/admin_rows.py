"""A changelist's rows, drawn at the cost of the values they show.

Django's ``result_list`` resolves every cell on its own: it looks the column up again, wraps it
with ``format_html``, reverses the change URL of each row and loops over the cells in the
template, about 15 µs a cell before the value is formatted. ``rows_html`` decides once per page
what each column is (the checkbox, a model field, an admin method, a boolean), builds the change
URL from one reversed template and hands the template one safe string per row. The HTML is the
stock one (``<th class="field-id"><a href=…>``, ``<td class="field-…">``, the row checkbox, the
empty value, the boolean icons, ``nowrap`` on dates), so scripts, styles and tests see the same
page. A changelist with editable rows, a popup or a ``to_field`` keeps the stock rendering.

Columns that stay cheap (``cell_*`` helpers): an admin method returns plain text or one
``format_html``; a long text is cut by the stylesheet with its whole value in ``title``
(``cell_truncated``); durations are compact (``duration_label``: "3h 12m").
"""

from __future__ import annotations

import html
from datetime import datetime

from django.contrib.admin.templatetags.admin_list import _boolean_icon, _coerce_field_name
from django.contrib.admin.templatetags.admin_urls import add_preserved_filters
from django.contrib.admin.utils import display_for_field, display_for_value, lookup_field, quote
from django.core.exceptions import FieldDoesNotExist, ObjectDoesNotExist
from django.db import models
from django.urls import NoReverseMatch, reverse
from django.utils.safestring import SafeString, mark_safe

_PK_MARK = "0pk0"


def html_text(value) -> str:
    """``value`` as HTML text: escaped, unless it is already safe (Django's ``conditional_escape``
    without its lazy-string wrapper, which costs more than the escaping on a page of cells)."""
    if hasattr(value, "__html__"):
        return value.__html__()
    return html.escape(str(value))


def duration_label(seconds: float | None) -> str:
    """A compact duration: "45s", "12m", "3h 12m", "4d 6h"; "—" for none."""
    if seconds is None:
        return "—"
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 60:
        return f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes}m" if minutes else f"{hours}h"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours}h" if hours else f"{days}d"


def cell_truncated(text: str, *, css: str = "cell-truncate"):
    """``text`` on one line, cut by the stylesheet at the column's width, whole in ``title``."""
    if not text:
        return ""
    text = html_text(text)
    return mark_safe(f'<span class="{css}" title="{text}">{text}</span>')


def cell_with_reason(badge: str, reason: str, *, title: str = ""):
    """A status ``badge`` with its ``reason`` beneath it (``title`` on hover: the reason itself by default)."""
    if not reason:
        return badge
    reason = html_text(reason)
    return mark_safe(f'{badge}<span class="cell-sub" title="{title or reason}">{reason}</span>')


def duration_since(moment: datetime | None, now: datetime) -> str:
    """``duration_label`` of the time from ``moment`` to ``now``; "—" for none."""
    return duration_label((now - moment).total_seconds()) if moment is not None else "—"


def cell_since(moment: datetime | None, now: datetime) -> SafeString | str:
    """How long ago ``moment`` was, compact, with the timestamp (UTC, to the second) in ``title``."""
    if moment is None:
        return "—"
    return mark_safe(f'<span title="{moment:%Y-%m-%d %H:%M:%S}">{duration_label((now - moment).total_seconds())}</span>')


class _Column:
    """How one column of ``list_display`` is drawn, decided once per page."""

    __slots__ = ("name", "open_tag", "close_tag", "kind", "getter", "field", "empty", "link")

    def __init__(self, name, open_tag, close_tag, kind, getter, field, empty, link):
        self.name, self.open_tag, self.close_tag = name, open_tag, close_tag
        self.kind, self.getter, self.field, self.empty, self.link = kind, getter, field, empty, link


def _plan(cl) -> list[_Column]:
    model_admin = cl.model_admin
    opts = cl.lookup_opts
    columns = []
    first = True
    for index, name in enumerate(cl.list_display):
        classes = ["field-%s" % _coerce_field_name(name, index)]
        empty = model_admin.get_empty_value_display()
        if cl.list_display_links is None:
            link = False
        elif first and not cl.list_display_links:
            link = True
        else:
            link = name in cl.list_display_links
        field = None
        if isinstance(name, str):  # a model field first, as ``lookup_field`` reads it
            try:
                field = opts.get_field(name)
            except FieldDoesNotExist:
                field = None
        if field is not None and field.is_relation and name == field.attname:
            # A foreign key's column (``run_id``): its value, never the related row.
            kind, getter = "auto", field.attname
        elif field is not None and not field.auto_created:
            if isinstance(field.remote_field, models.ManyToOneRel):
                kind, getter = "related", field.name
            else:  # a plain text field is escaped as it is; choices, numbers and dates by Django
                plain = isinstance(field, (models.CharField, models.TextField)) and not field.flatchoices
                kind, getter = ("text" if plain else "field"), field.attname
            if isinstance(field, (models.DateField, models.TimeField, models.ForeignKey)):
                classes.append("nowrap")
        else:
            # The row checkbox, an admin method, a callable, the automatic primary key, or else a
            # model attribute (read through ``lookup_field`` on every row, as the stock list does).
            kind, getter = "lookup", None
            if name == "action_checkbox":
                classes = ["action-checkbox"]
                kind, getter = "method", model_admin.action_checkbox
            elif callable(name):
                kind, getter = "callable", name
            elif hasattr(model_admin, name) and name != "__str__":
                attr = getattr(model_admin, name)
                kind = "boolean" if getattr(attr, "boolean", False) else "method"
                getter = attr
                empty = getattr(attr, "empty_value_display", empty)
            elif field is not None:  # the automatic primary key
                kind, getter = "auto", field.attname
        tag = "th" if link and first else "td"
        if link:
            first = False
        columns.append(_Column(name, mark_safe(f'<{tag} class="{" ".join(classes)}">'), mark_safe(f"</{tag}>"),
                               kind, getter, field, empty, link))
    return columns


def _value_html(column: _Column, row, boolean_icons: dict):
    kind = column.kind
    if kind == "text":
        value = getattr(row, column.getter)
        return html.escape(value) if value and value.strip() else column.empty
    if kind == "field":
        value = getattr(row, column.getter)
        if isinstance(value, str) and not value.strip():
            value = ""
        return html_text(display_for_field(value, column.field, column.empty))
    if kind == "related":
        try:
            value = getattr(row, column.getter)
        except ObjectDoesNotExist:
            return column.empty
        return column.empty if value is None else html.escape(str(value))
    if kind in ("method", "boolean", "callable"):
        try:
            value = column.getter(row)
        except ObjectDoesNotExist:
            return column.empty
        if kind == "boolean":
            if value not in boolean_icons:
                boolean_icons[value] = _boolean_icon(value)
            return boolean_icons[value]
        if isinstance(value, SafeString):
            return value if value.strip() else column.empty
        if isinstance(value, str):
            return html.escape(value) if value.strip() else column.empty
        return html_text(display_for_value(value, column.empty))
    if kind == "auto":
        value = getattr(row, column.getter)
        return column.empty if value is None else html.escape(str(value))
    try:
        _, attr, value = lookup_field(column.name, row, None)
    except ObjectDoesNotExist:
        return column.empty
    if isinstance(value, str) and not value.strip():
        return column.empty
    return html_text(display_for_value(value, column.empty, getattr(attr, "boolean", False)))


def _change_url(cl):
    """The change page URL of a row as (prefix, suffix) around its quoted primary key, or None."""
    try:
        url = reverse(f"admin:{cl.opts.app_label}_{cl.opts.model_name}_change", args=(quote(_PK_MARK),),
                      current_app=cl.model_admin.admin_site.name)
    except NoReverseMatch:
        return None
    url = add_preserved_filters({"preserved_filters": cl.preserved_filters, "opts": cl.opts}, url)
    prefix, _, suffix = url.partition(_PK_MARK)
    return html.escape(prefix), html.escape(suffix)


def rows_html(cl) -> list[SafeString] | None:
    """Each row of the page as one safe string of cells, or None when the stock rendering must
    draw the page (editable rows, a popup, a ``to_field``)."""
    if cl.formset or cl.is_popup or cl.to_field:
        return None
    columns = _plan(cl)
    url = _change_url(cl)
    boolean_icons: dict = {}
    rows = []
    for row in cl.result_list:
        cells = []
        for column in columns:
            value = _value_html(column, row, boolean_icons)
            if column.link and url is not None:
                value = f'<a href="{url[0]}{html.escape(quote(str(row.pk)))}{url[1]}">{value}</a>'
            cells.append(f"{column.open_tag}{value}{column.close_tag}")
        rows.append(mark_safe("".join(cells)))
    return rows
