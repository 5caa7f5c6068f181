"""Liveness and database health."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from vramtune.service.api.deps import StateDep
from vramtune.service.errors import Unavailable

router = APIRouter(tags=["health"])


@router.get("/health")
def health(state: StateDep) -> dict[str, str]:
    """{"status": "ok"} when the database answers; 503 otherwise."""
    try:
        with state.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as exc:  # any failure to reach the database is "unavailable"
        raise Unavailable(f"database unavailable: {type(exc).__name__}") from exc
    return {"status": "ok"}
