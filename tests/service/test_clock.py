"""The server's one clock: every route takes "now" from AppState.clock, so time can be moved."""

from __future__ import annotations

from datetime import datetime, timedelta

from fastapi.testclient import TestClient

T0 = datetime(2030, 1, 1, 12, 0, 0)
WORKER = {
    "name": "clocked",
    "device": "cpu",
    "card": {"model": "Simulated", "total_bytes": 2**30, "free_bytes": 2**30},
    "tasks": ["quadratic"],
}


def test_routes_read_the_clock_of_the_app_state(app_client: TestClient) -> None:
    now = [T0]
    state = app_client.app.state.vt  # type: ignore[attr-defined]
    state.clock = lambda: now[0]
    stale_s = state.settings.worker_stale_s
    assert app_client.post("/api/v1/workers", json=WORKER).status_code == 201

    [fresh] = app_client.get("/api/v1/workers").json()["workers"]
    assert fresh["last_heartbeat"].startswith("2030-01-01T12:00:00")
    assert fresh["state"] == "live"

    now[0] = T0 + timedelta(seconds=stale_s + 1)
    [later] = app_client.get("/api/v1/workers").json()["workers"]
    assert later["state"] == "stale"
    [card] = app_client.get("/api/v1/dashboard/fleet").json()["workers"]
    assert card["state"] == "lost"  # the dashboard names a worker past worker_stale_s lost
