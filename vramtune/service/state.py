"""What the server holds while it runs: settings, database engine, sessions, Optuna storage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from optuna.storages import BaseStorage
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from vramtune.service.settings import Settings
from vramtune.service.wire import Heartbeat, HeartbeatReply


def utcnow() -> datetime:
    """Now in UTC without tz, as Optuna and vramtune store every datetime: the default clock."""
    return datetime.now(UTC).replace(tzinfo=None)


class HeartbeatSink(Protocol):
    """Where the heartbeat route hands a worker's heartbeat (vramtune.service.fleet.heartbeats).

    `beat` answers once the heartbeat is written: the leases it names renewed, stop orders back.
    The state holds it through this protocol so that nothing the fleet imports imports the fleet.
    """

    async def beat(
        self, worker_id: int, body: Heartbeat, token_id: int | None
    ) -> HeartbeatReply: ...


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
    heartbeats: HeartbeatSink | None = None  # set by vramtune.service.app.build_state
    clock: Callable[[], datetime] = field(default=utcnow)
