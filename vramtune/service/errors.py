"""Domain errors: what a use case raises when a client can act on it, with its HTTP status.

They carry no HTTP machinery; vramtune/service/api/errors.py turns them (and storage errors) into
answers, once, at the HTTP edge.
"""

from __future__ import annotations

from typing import Any


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
