"""Domain errors and the one place that turns every error into an HTTP answer."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from optuna.exceptions import DuplicatedStudyError, StorageInternalError, UpdateFinishedTrialError
from sqlalchemy.exc import DBAPIError, OperationalError, TimeoutError as PoolTimeout

log = logging.getLogger("vramtune.errors")


class DomainError(Exception):
    """An error a client can act on; ``status`` is its HTTP status."""

    status = 400

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def body(self) -> Any:
        """What goes under "detail" in the response."""
        return self.detail


class NotFound(DomainError):
    """The study, trial or worker named does not exist."""

    status = 404


class Forbidden(DomainError):
    """The caller's token may not act on this object (a worker another token registered)."""

    status = 403


class TooMany(DomainError):
    """The caller is over a limit of the service (workers per token)."""

    status = 429


class Conflict(DomainError):
    """The request contradicts the current state (a duplicate name, a finished trial)."""

    status = 409


class LeaseLost(Conflict):
    """The lease presented is no longer the trial's active lease."""


class Unavailable(DomainError):
    """The database cannot be reached now; retry later."""

    status = 503


class Invalid(DomainError):
    """A field of the request is invalid in a way only the server can tell."""

    status = 422

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def body(self) -> Any:
        """The same shape as FastAPI's own validation errors, so clients parse one format."""
        loc = ["body", *self.field.split(".")]
        return [{"type": "value_error", "loc": loc, "msg": self.message, "input": None}]


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
    log.warning("database unavailable on %s %s: %s", request.method, request.url.path, exc)
    return _json(503, "database unavailable; retry later")


def _is_disconnect(exc: DBAPIError) -> bool:
    return isinstance(exc, OperationalError) or exc.connection_invalidated


async def _storage_error(request: Request, exc: Exception) -> JSONResponse:
    cause = exc.__cause__
    if isinstance(cause, DBAPIError) and not _is_disconnect(cause):
        return await _unexpected(request, exc)
    log.warning("Optuna storage error on %s %s: %s", request.method, request.url.path, exc)
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
