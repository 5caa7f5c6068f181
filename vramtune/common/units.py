"""Byte counts in human units (MiB, GiB): what every page, message and advice shows."""

from __future__ import annotations

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
_UNITS = (("TiB", 1024 * GIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB))


def human_bytes(count: int | float | None) -> str:
    """``count`` bytes in the largest binary unit that keeps a number >= 1 ("154.4 MiB").

    Three significant digits at most, as the dashboard's own formatter (common.js ``bytes``)
    shows them, so a message and the table beside it read the same.
    """
    if count is None:
        return "\u2013"  # an en dash, as the dashboard shows a missing value
    sign = "-" if count < 0 else ""
    size = abs(float(count))
    for unit, scale in _UNITS:
        if size >= scale:
            return f"{sign}{_digits(size / scale)} {unit}"
    return f"{sign}{int(size)} B"


def _digits(value: float) -> str:
    """Three significant digits without a trailing ".0" fraction on large values."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def percent(fraction: float) -> str:
    """A signed relative difference as a whole percentage ("+260 %")."""
    return f"{fraction * 100:+.0f} %"
