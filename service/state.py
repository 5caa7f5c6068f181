"""What the server holds while it runs: settings, database engine, sessions, Optuna storage."""

from __future__ import annotations

from dataclasses import dataclass

from optuna.storages import BaseStorage
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.settings import Settings


@dataclass
class AppState:
    """Built by the app's lifespan and kept at ``app.state.vt``."""

    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    storage: BaseStorage
