"""Token lifetimes such as ``30d`` (`vramtune.service.wire.Duration`) as time spans."""

from __future__ import annotations

from datetime import timedelta

DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_of(text: str) -> timedelta:
    """A Duration (``30d``) as a timedelta."""
    return timedelta(seconds=int(text[:-1]) * DURATION_UNITS[text[-1]])
