"""What the server holds while it runs: settings, database engine, sessions, Optuna storage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from optuna.storages import BaseStorage
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.settings import Settings

if TYPE_CHECKING:
    from service.fleet.heartbeats import HeartbeatBatcher


def utcnow() -> datetime:
    """Now in UTC without tz, as Optuna and vramtune store every datetime: the default clock."""
    return datetime.now(UTC).replace(tzinfo=None)


@dataclass
class AppState:
    """Built by the app's lifespan and kept at ``app.state.vt``.

    ``clock`` is the server's one source of "now": use cases take ``now`` from it (routes
    through ``NowDep``), so a test can move time by handing the app another clock.
    """

    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    storage: BaseStorage
    heartbeats: HeartbeatBatcher | None = None  # set by service.app.build_state
    clock: Callable[[], datetime] = field(default=utcnow)
