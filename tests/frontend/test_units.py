"""The one size filter: binary units everywhere."""

import pytest
from django.template import Context, Template

from frontend.templatetags.units import binary_size


@pytest.mark.parametrize(
    ("value", "unit", "shown"),
    [
        (0, "bytes", "0 bytes"),
        (1, "bytes", "1 byte"),
        (1023, "bytes", "1023 bytes"),
        (1024, "bytes", "1 KiB"),
        (1536, "bytes", "1.5 KiB"),
        (5 * 1024**2, "bytes", "5 MiB"),
        (int(2.25 * 1024**3), "bytes", "2.2 GiB"),
        (3 * 1024**4, "bytes", "3 TiB"),
        (32768, "MiB", "32 GiB"),
        (512, "MiB", "512 MiB"),
        (None, "bytes", "—"),
        ("lots", "bytes", "—"),
        (10, "furlongs", "—"),
    ],
)
def test_binary_size_formats_in_binary_units(value, unit, shown):
    assert binary_size(value, unit) == shown


def test_filter_is_usable_from_templates():
    html = Template('{% load units %}{{ n|binary_size }} / {{ m|binary_size:"MiB" }}').render(
        Context({"n": 2 * 1024**2, "m": 1024})
    )
    assert html == "2 MiB / 1 GiB"
