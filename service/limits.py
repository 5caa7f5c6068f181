"""Request size limit: bodies over Settings.max_request_bytes get a 413 before the app runs."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyTooLarge(Exception):
    """The body grew past the limit while it was being read."""


class BodySizeLimit:
    """ASGI middleware: read the body up to ``max_bytes``, refuse it whole if it is larger.

    The body is buffered before the app sees any of it, so a refused request never reaches a
    route and writes nothing; a declared Content-Length over the limit is refused unread.
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
