"""The reaper: ends expired leases and re-offers their trials (filled by the fleet issue)."""

from __future__ import annotations

import asyncio

from service.state import AppState


async def reaper_loop(state: AppState, stop: asyncio.Event) -> None:
    """Run until ``stop`` is set; every ``state.settings.reaper_interval_s`` reap expired leases."""
    await stop.wait()
