"""HTTP details of the worker protocol routes that FastAPI's defaults get wrong."""

from __future__ import annotations

import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute


def json_safe(value: Any) -> Any:
    """A validation error's content with NaN and infinities as strings (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


class FiniteErrorsRoute(APIRoute):
    """A route whose 422 for a NaN or infinite input is a 422, not a 500 from the encoder.

    Python's JSON parser accepts ``NaN`` and ``Infinity``; the wire models refuse them, and
    FastAPI then echoes the input in the error body, which Starlette cannot encode.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """The default handler, with validation errors made JSON-safe."""
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as error:
                raise RequestValidationError(json_safe(error.errors()), body=None) from None

        return route
