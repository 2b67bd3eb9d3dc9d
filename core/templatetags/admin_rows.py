"""``{% scaled_result_list cl %}``: the stock ``{% result_list cl %}`` with its rows drawn by
``core.admin_rows.rows_html`` (one safe string per row); the headers, the template
(``admin/change_list_results.html``) and the HTML stay Django's."""

from django import template
from django.contrib.admin.templatetags.admin_list import ResultList, result_headers, result_list
from django.contrib.admin.templatetags.base import InclusionAdminNode

from core.admin_rows import rows_html

register = template.Library()


def scaled_result_list(cl):
    rows = rows_html(cl)
    if rows is None:
        return result_list(cl)
    headers = list(result_headers(cl))
    return {"cl": cl, "result_hidden_fields": [], "result_headers": headers,
            "num_sorted_fields": sum(1 for header in headers if header["sortable"] and header["sorted"]),
            "results": [ResultList(None, [row]) for row in rows]}


@register.tag(name="scaled_result_list")
def scaled_result_list_tag(parser, token):
    return InclusionAdminNode(parser, token, func=scaled_result_list, template_name="change_list_results.html",
                              takes_context=False)
