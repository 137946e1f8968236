"""Query filters for values the database must be able to hold.

django-filter hands a parsed value straight to the query: a decimal id beyond 64 bits, or a timestamp with a
UTC offset PostgreSQL does not accept (it allows -15:59..+15:59, Python up to +-23:59), makes the database
raise and the request a 500. These filters refuse such values as a 400 on the parameter instead.
"""

from __future__ import annotations

from datetime import UTC

from django import forms
from django_filters import rest_framework as filters
from django_filters.fields import IsoDateTimeField


class IdFilter(filters.NumberFilter):
    """A row id: an integer the database can hold."""

    field_class = forms.IntegerField

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("min_value", 1)
        kwargs.setdefault("max_value", 2**63 - 1)
        super().__init__(*args, **kwargs)


class UTCIsoDateTimeField(IsoDateTimeField):
    def to_python(self, value):
        parsed = super().to_python(value)
        if parsed is None or parsed.tzinfo is None:
            return parsed
        try:
            return parsed.astimezone(UTC)
        except OverflowError:
            raise forms.ValidationError("Give a date and time between the years 1 and 9999.") from None


class UTCIsoDateTimeFilter(filters.IsoDateTimeFilter):
    """An ISO 8601 timestamp, converted to UTC before it reaches the query."""

    field_class = UTCIsoDateTimeField
