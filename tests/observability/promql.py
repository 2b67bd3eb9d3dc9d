"""Metric names in PromQL expressions, and the names ``/metrics`` exposes.

A small tokenizer, enough for our rules and dashboard: strings, label matchers, ranges,
grouping clauses, numbers and Grafana variables are removed; an identifier followed by ``(``
is a function; keywords are dropped. What is left are metric names.
"""

from __future__ import annotations

import re

KEYWORDS = frozenset({"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
                      "offset", "bool", "inf", "nan", "atan2"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NUMBER = re.compile(r"(?<![\w:])\d+(?:\.\d+)?(?:e[+-]?\d+)?(?:ms|[smhdwy])?\b", re.IGNORECASE)
_IDENTIFIER = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` reads."""
    text = _STRING.sub(" ", expr)
    text = _GRAFANA_VARIABLE.sub("1m", text)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        if match.group(1):  # a function call
            continue
        name = match.group(0).strip()
        if name.lower() not in KEYWORDS:
            names.add(name)
    return names


def exposed_names(text: str) -> set[str]:
    """Every series name a scrape of ``text`` can hold: its samples, and the families it declares
    (a family without samples yet still counts, with the suffixes of its type)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind == "histogram":
                names.update({f"{name}_bucket", f"{name}_sum", f"{name}_count"})
            if kind == "counter" and not name.endswith("_total"):
                names.add(f"{name}_total")
        elif line and not line.startswith("#"):
            names.add(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0))
    return names
