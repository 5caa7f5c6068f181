"""The dashboard's one error of its own: a query parameter only the server can judge."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError


def invalid_query(field: str, message: str, value: object) -> RequestValidationError:
    """A 422 in FastAPI's own shape, naming the query parameter (as its validation does)."""
    return RequestValidationError(
        [{"type": "value_error", "loc": ("query", field), "msg": message, "input": value}]
    )
