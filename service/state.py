"""What the server holds while it runs: settings, database engine, sessions, Optuna storage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from optuna.storages import BaseStorage
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.settings import Settings

if TYPE_CHECKING:
    from service.heartbeats import HeartbeatBatcher


@dataclass
class AppState:
    """Built by the app's lifespan and kept at ``app.state.vt``."""

    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    storage: BaseStorage
    heartbeats: HeartbeatBatcher | None = None  # set by service.app.build_state
