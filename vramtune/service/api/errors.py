"""The one place that turns every error (domain, storage, Optuna) into an HTTP answer."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from optuna.exceptions import DuplicatedStudyError, StorageInternalError, UpdateFinishedTrialError
from sqlalchemy.exc import DBAPIError, OperationalError, TimeoutError as PoolTimeout

from vramtune.common.logs import log_outage
from vramtune.service.errors import DomainError

log = logging.getLogger("vramtune.errors")


def _json(status: int, detail: Any) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


async def _domain(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DomainError)
    return _json(exc.status, exc.body())


async def _duplicated(_request: Request, exc: Exception) -> JSONResponse:
    return _json(409, str(exc))


async def _finished(_request: Request, exc: Exception) -> JSONResponse:
    return _json(409, f"trial already finished: {exc}")


async def _database_down(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, DBAPIError) and not _is_disconnect(exc):
        return await _unexpected(request, exc)
    log_outage(log, "request", exc, method=request.method, path=request.url.path)
    return _json(503, "database unavailable; retry later")


def _is_disconnect(exc: DBAPIError) -> bool:
    return isinstance(exc, OperationalError) or exc.connection_invalidated


async def _storage_error(request: Request, exc: Exception) -> JSONResponse:
    cause = exc.__cause__
    if isinstance(cause, DBAPIError) and not _is_disconnect(cause):
        return await _unexpected(request, exc)
    log_outage(log, "optuna storage", cause or exc, method=request.method, path=request.url.path)
    return _json(503, "database unavailable; retry later")


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _json(500, "internal server error")


def install_error_handlers(app: FastAPI) -> None:
    """Translate domain, storage and unexpected errors into {"detail": ...} answers."""
    app.add_exception_handler(DomainError, _domain)
    app.add_exception_handler(DuplicatedStudyError, _duplicated)
    app.add_exception_handler(UpdateFinishedTrialError, _finished)
    app.add_exception_handler(DBAPIError, _database_down)
    app.add_exception_handler(PoolTimeout, _database_down)
    app.add_exception_handler(StorageInternalError, _storage_error)
    app.add_exception_handler(Exception, _unexpected)
