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


def format_duration(seconds: float) -> str:
    """0.42 -> "0.4 s", 65 -> "1 min 5 s", 3720 -> "1 h 2 min"."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


@register.filter
def duration(value) -> str:
    """A timedelta (or seconds) as a short duration; None shows as "—"."""
    if value is None:
        return "—"
    seconds = value.total_seconds() if hasattr(value, "total_seconds") else float(value)
    return format_duration(max(seconds, 0.0))


@register.filter
def binary_size(value, unit: str = "bytes") -> str:
    """Format a size given in ``unit`` (bytes by default); anything that is not a number shows as "—"."""
    try:
        number = float(value) * SCALE[unit]
    except (TypeError, ValueError, KeyError):
        return "—"
    return format_binary_size(number)
