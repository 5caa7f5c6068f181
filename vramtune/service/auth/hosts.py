"""The Host check of auth-off mode: a defence against DNS rebinding.

With auth off every caller is an admin, and the server trusts that only this machine can reach
it. A web page can break that: its own name, rebound in DNS to 127.0.0.1 after the page has
loaded, makes the browser send the page's requests to the local server as same-origin ones,
able to create and delete studies. Those requests carry the page's name in their Host header,
so answering only the names this server is known by (Settings.allowed_hosts) shuts it out.
"""

from __future__ import annotations

import ipaddress

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

ANY_ADDRESS = {"0.0.0.0", "::", ""}


def host_name(header: str) -> str:
    """The name of a Host header, without its port, brackets or case: "[::1]:8000" -> "::1"."""
    text = header.strip().lower()
    if text.startswith("["):  # an IPv6 literal, with or without a port
        return text[1:].partition("]")[0]
    name, _, _port = text.rpartition(":") if text.count(":") == 1 else (text, "", "")
    return name


def allowed_names(listed: str, listen_host: str) -> frozenset[str]:
    """The allowed names from the comma-separated setting, plus the address listened on."""
    names = {host_name(part) for part in listed.split(",") if part.strip()}
    if listen_host not in ANY_ADDRESS:
        names.add(host_name(listen_host if ":" not in listen_host else f"[{listen_host}]"))
    return frozenset(names)


def _canonical(name: str) -> str:
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name.rstrip(".")  # "localhost." is "localhost"


class TrustedHosts:
    """ASGI middleware: a 400 for a request whose Host header is not an allowed name."""

    def __init__(self, app: ASGIApp, names: frozenset[str]) -> None:
        self.app = app
        self.names = frozenset(_canonical(name) for name in names)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._trusted(scope):
            await self.app(scope, receive, send)
            return
        detail = (
            "Host: not a name of this server (auth is off, so only the names in "
            "VRAMTUNE_ALLOWED_HOSTS are answered, against DNS rebinding)"
        )
        await JSONResponse({"detail": detail}, status_code=400)(scope, receive, send)

    def _trusted(self, scope: Scope) -> bool:
        # Only the Host header decides, never scope["client"]: with proxy headers on, a page's
        # X-Forwarded-For sets the client (issue 47). In-process tests list their Host
        # ("testserver") in allowed_hosts like any other name.
        hosts = [value for key, value in scope["headers"] if key == b"host"]
        if len(hosts) != 1:
            return False
        return _canonical(host_name(hosts[0].decode("latin-1"))) in self.names
