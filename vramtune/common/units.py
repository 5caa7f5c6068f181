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


def human_pair(first: int, second: int) -> tuple[str, str]:
    """Two byte counts in human units that never read the same unless they are: where three
    digits round them alike ("0.042 GiB" and "0.042 GiB" 157 B apart), both in exact bytes."""
    said = human_bytes(first), human_bytes(second)
    if said[0] != said[1] or first == second:
        return said
    return f"{first:,} B", f"{second:,} B"


def infeasible_reason(footprint: int, largest: int, margin: float) -> str:
    """Why a trial fits no card, with what the largest card leaves after the study's safety
    margin: "needs 231 MiB; the largest card has 256 MiB" alone reads as if it fitted."""
    needs, card = human_pair(footprint, largest)
    usable = human_bytes(int(largest * (1.0 - margin)))
    return (
        f"needs {needs}; the largest live card has {card}, {usable} usable after the "
        f"{margin:.0%} safety margin"
    )


def percent(fraction: float) -> str:
    """A signed relative difference as a whole percentage ("+260 %")."""
    return f"{fraction * 100:+.0f} %"
