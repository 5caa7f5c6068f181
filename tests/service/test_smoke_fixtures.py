"""Temporary smoke test of the shared fixtures."""

from __future__ import annotations

import httpx


def test_health_over_http(migrated_url, start_server):
    server = start_server(migrated_url)
    assert httpx.get(f"{server.url}/api/v1/health").json() == {"status": "ok"}
    server.restart()
    assert httpx.get(f"{server.url}/api/v1/health").json() == {"status": "ok"}


def test_health_in_process(app_client):
    assert app_client.get("/api/v1/health").json() == {"status": "ok"}
