"""Request limits: bodies over Settings.max_request_bytes get a 413 before the app runs, and
JSON bodies holding NaN or an infinity (which Python's parser accepts), or nested deeper than
MAX_JSON_DEPTH, a 422 naming the field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(Exception):
    """The body grew past the limit while it was being read."""


class BodySizeLimit:
    """ASGI middleware: read the body up to ``max_bytes``, refuse it whole if it is larger.

    The body is buffered before the app sees any of it, so a refused request never reaches a
    route and writes nothing; a declared Content-Length over the limit is refused unread. A
    JSON body with a non-finite number is refused too: every wire float is finite, and a
    validation error echoing NaN back could not even be encoded as JSON.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared == -1:
            await _answer(400, "Content-Length: not a non-negative integer", scope, receive, send)
            return
        try:
            if declared is not None and declared > self.max_bytes:
                raise BodyTooLarge
            body = await self._read(receive)
        except BodyTooLarge:
            detail = f"body: larger than the limit of {self.max_bytes} bytes"
            await _answer(413, detail, scope, receive, send)
            return
        deep = too_deep(body)
        if deep is not None:
            await _refuse(_too_deep_error(deep), scope, receive, send)
            return
        where = non_finite_number(body)
        if where is not None:
            await _refuse(_non_finite_error(where), scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left; nothing to serve
                return b""
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


_NON_FINITE = object()  # stands for a NaN or infinite number while a body is scanned


def _finite_or_marker(text: str) -> Any:
    value = float(text)
    return value if math.isfinite(value) else _NON_FINITE  # 1e999 overflows to inf


def non_finite_number(body: bytes) -> list[str | int] | None:
    """The path of the first NaN or infinite number in a JSON body; None if none (or not JSON)."""
    if not body:
        return None
    try:
        document = json.loads(
            body, parse_constant=lambda _name: _NON_FINITE, parse_float=_finite_or_marker
        )
        return _path_to_marker(document)
    except (ValueError, RecursionError):  # not JSON (or absurdly deep): the app answers it
        return None


def _path_to_marker(value: Any) -> list[str | int] | None:
    if value is _NON_FINITE:
        return []
    items: list[tuple[str | int, Any]] = []
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    for key, item in items:
        found = _path_to_marker(item)
        if found is not None:
            return [key, *found]
    return None


# Deeper than any wire model nests (a study spec reaches ~8 levels), shallow enough that
# neither Python's parser nor pydantic's serializer hits its recursion limit (a 400 or a 500
# naming no field).
MAX_JSON_DEPTH = 64
# A JSON string (escapes included) or a structural character: strings are skipped whole, so
# brackets inside them do not count.
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{},]')


def too_deep(body: bytes) -> list[str | int] | None:
    """The path to the first container nested past MAX_JSON_DEPTH; None if none (or not JSON).

    Scanned as tokens, not parsed: a body too deep for the parser still names its field.
    """
    if body.count(b"{") + body.count(b"[") <= MAX_JSON_DEPTH:  # cannot be that deep: no scan
        return None
    path: list[str | int] = []  # per open container: its current key or index
    expecting_key: list[bool] = []  # per open container: an object awaiting its next key
    for match in _JSON_TOKEN.finditer(body):
        token = match.group()
        if token in (b"{", b"["):
            if len(path) == MAX_JSON_DEPTH:
                return path
            path.append(0 if token == b"[" else "")
            expecting_key.append(token == b"{")
        elif token in (b"}", b"]") and path:
            path.pop()
            expecting_key.pop()
        elif token == b"," and path:
            _next_item(path, expecting_key)
        elif path and expecting_key[-1]:  # a string in key position names the field
            path[-1] = _key_text(token)
            expecting_key[-1] = False
    return None


def _next_item(path: list[str | int], expecting_key: list[bool]) -> None:
    """After a comma: the next index of an array, the next key of an object."""
    current = path[-1]
    if isinstance(current, int):
        path[-1] = current + 1
    else:
        expecting_key[-1] = True


def _key_text(token: bytes) -> str:
    try:
        return str(json.loads(token))
    except ValueError:  # a malformed string: the parser will answer the body
        return token.decode("utf-8", "replace").strip('"')


def _too_deep_error(where: list[str | int]) -> dict[str, Any]:
    return {
        "type": "too_deep",
        "loc": ["body", *where],
        "msg": f"JSON nested deeper than {MAX_JSON_DEPTH} levels",
        "input": None,
    }


def _non_finite_error(where: list[str | int]) -> dict[str, Any]:
    return {
        "type": "finite_number",
        "loc": ["body", *where],
        "msg": "Input should be a finite number (JSON has no NaN or Infinity)",
        "input": None,
    }


async def _refuse(error: dict[str, Any], scope: Scope, receive: Receive, send: Send) -> None:
    """A 422 in FastAPI's own error shape, the field named by its location."""
    await JSONResponse({"detail": [error]}, status_code=422)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    """The declared length; None when absent, -1 when malformed."""
    for key, value in scope["headers"]:
        if key == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() and len(text) <= 20 else -1
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields the buffered body once, then waits on the client (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _answer(status: int, detail: str, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse({"detail": detail}, status_code=status)(scope, receive, send)
