"""Filters shared by the API's lists."""

from __future__ import annotations

import datetime

import django_filters
from django import forms
from django_filters.fields import IsoDateTimeField


class UtcIsoDateTimeField(IsoDateTimeField):
    """An ISO 8601 date-time, normalized to UTC: PostgreSQL refuses offsets past ±15:59, and a
    date near year 1 or 9999 may not survive the shift (both are bad input, never a 500)."""

    def to_python(self, value):
        parsed = super().to_python(value)
        if parsed is None:
            return None
        try:
            return parsed.astimezone(datetime.timezone.utc)
        except (OverflowError, ValueError) as exc:
            raise forms.ValidationError("date-time out of range", code="invalid") from exc


class UtcIsoDateTimeFilter(django_filters.IsoDateTimeFilter):
    field_class = UtcIsoDateTimeField
