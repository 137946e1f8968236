"""One way to show sizes everywhere: binary units (KiB, MiB, GiB, TiB), as the upload page's script does.

``{{ version.size_bytes|binary_size }}``; for counts already in MiB (npu-smi's "MB" are MiB):
``{{ device.hbm_used_mb|binary_size:"MiB" }}``.
"""

from __future__ import annotations

from django import template

register = template.Library()

UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")
SCALE = {"bytes": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


def format_binary_size(value: float | int) -> str:
    """1536 -> "1.5 KiB", 1 -> "1 byte", 10 * 2**30 -> "10 GiB" (one decimal, dropped when .0)."""
    size = float(value)
    if abs(size) < 1024:
        whole = int(size)
        return f"{whole} byte{'' if whole == 1 else 's'}"
    for unit in UNITS[1:]:
        size /= 1024
        if abs(size) < 1024 or unit == UNITS[-1]:
            return f"{size:.1f} {unit}".replace(".0 ", " ")
    raise AssertionError("unreachable")


@register.filter
def binary_size(value, unit: str = "bytes") -> str:
    """Format a size given in ``unit`` (bytes by default); anything that is not a number shows as "—"."""
    try:
        number = float(value) * SCALE[unit]
    except (TypeError, ValueError, KeyError):
        return "—"
    return format_binary_size(number)
