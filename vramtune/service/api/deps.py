"""Request dependencies, declared once as Annotated aliases.

The ones that only read what the app holds are ``async``: FastAPI runs a plain ``def``
dependency in its thread pool, one hop (and a wait for a free thread) per dependency per
request, which under load cost the worker calls more than the dependencies themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Annotated, Any, cast

from fastapi import Depends, Path, Query, Request
from optuna.storages import BaseStorage
from sqlalchemy.orm import Session

from vramtune.service.db.engine import read_one_snapshot
from vramtune.service.db.tables import MAX_ROW_ID
from vramtune.service.settings import Settings
from vramtune.service.state import AppState


async def get_state(request: Request) -> AppState:
    """The AppState the lifespan built."""
    return cast(AppState, request.app.state.vt)


StateDep = Annotated[AppState, Depends(get_state)]


async def get_settings(state: StateDep) -> Settings:
    """The server's settings."""
    return state.settings


def get_session(state: StateDep) -> Iterator[Session]:
    """One transaction per request: commit when the handler returns, roll back if it raises."""
    with state.sessions.begin() as session:
        yield session


def get_read_session(state: StateDep) -> Iterator[Session]:
    """get_session for a request that only reads: all its statements see one snapshot
    (vramtune.service.db.engine.read_one_snapshot), so what it answers belongs to one moment."""
    with state.sessions.begin() as session:
        read_one_snapshot(session)
        yield session


async def get_storage(state: StateDep) -> BaseStorage:
    """The Optuna storage on the server's database."""
    return state.storage


async def get_now(state: StateDep) -> datetime:
    """Now, by the server's clock (AppState.clock)."""
    return state.clock()


SettingsDep = Annotated[Settings, Depends(get_settings)]
# scope="function": the commit happens before the response is sent, so a client that got a 2xx
# reads its own write on the next call.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
ReadSessionDep = Annotated[Session, Depends(get_read_session, scope="function")]
StorageDep = Annotated[BaseStorage, Depends(get_storage)]
NowDep = Annotated[datetime, Depends(get_now)]


def path_id(description: str, low: int = 1) -> Any:
    """A path parameter naming a row by its id: ``low`` to MAX_ROW_ID, so that a larger one is
    a 422 naming the parameter, never a database error (PostgreSQL's INTEGER overflows)."""
    return Path(ge=low, le=MAX_ROW_ID, description=_bounded(description, low))


def query_id(description: str, low: int = 1) -> Any:
    """A query parameter naming a row by its id, bounded as ``path_id``."""
    return Query(ge=low, le=MAX_ROW_ID, description=_bounded(description, low))


def _bounded(description: str, low: int) -> str:
    return f"{description} ({low} to 2**31 - 1, else 422)"
