"""The FastAPI application factory; nothing connects until the lifespan starts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import anyio.to_thread
from fastapi import FastAPI

from vramtune.service import dashboard
from vramtune.service.api.errors import install_error_handlers
from vramtune.service.api.routes import auth, health, studies, trials, workers
from vramtune.service.auth.guard import install_auth
from vramtune.service.db.engine import make_engine, make_sessions
from vramtune.service.db.migrate import require_migrated
from vramtune.service.fleet import reaper
from vramtune.service.fleet.heartbeats import HeartbeatBatcher
from vramtune.service.limits import BodySizeLimit
from vramtune.service.metrics import install_metrics
from vramtune.service.optuna.glue import dispose_storage, make_storage
from vramtune.service.settings import Settings
from vramtune.service.state import AppState
from vramtune.service.wire import API_PREFIX

__all__ = ["AppState", "create_app"]

log = logging.getLogger("vramtune.app")


def build_state(settings: Settings) -> AppState:
    """Engine, sessions and Optuna storage on the settings' database, which must be migrated."""
    engine = make_engine(settings.database_url)
    try:
        require_migrated(engine)
        storage = make_storage(settings.database_url)
    except BaseException:
        engine.dispose()
        raise
    state = AppState(settings, engine, make_sessions(engine), storage)
    state.heartbeats = HeartbeatBatcher(state)
    return state


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Build the state, run the reaper beside the server, and tear both down on shutdown."""
    settings: Settings = app.state.settings
    # Sync routes run on AnyIO's thread limiter: fewer threads, less contention for the GIL.
    anyio.to_thread.current_default_thread_limiter().total_tokens = settings.threads
    state = await asyncio.to_thread(build_state, settings)
    app.state.vt = state
    stop = asyncio.Event()
    reaper_task = asyncio.create_task(reaper.reaper_loop(state, stop), name="vramtune-reaper")
    try:
        yield
    finally:
        stop.set()
        with suppress(asyncio.CancelledError):
            await asyncio.wait_for(reaper_task, timeout=10)
        dispose_storage(state.storage)
        state.engine.dispose()


def create_app(settings: Settings | None = None) -> FastAPI:
    """The vramtune server; settings default to the environment's ``VRAMTUNE_*``."""
    settings = settings or Settings()
    app = FastAPI(title="vramtune", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    install_error_handlers(app)
    install_metrics(app)  # innermost middleware: times what the routes answer
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    install_auth(app, settings)  # after BodySizeLimit: the guard is outermost
    for module in (health, auth, studies, workers, trials):
        app.include_router(module.router, prefix=API_PREFIX)
    app.include_router(dashboard.router)
    return app
