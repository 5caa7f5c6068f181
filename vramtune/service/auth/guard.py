"""The guard: one ASGI middleware that authenticates and authorizes every request by POLICY.

A middleware rather than a route dependency, so that it sees every route of the app (API
routes, the docs, mounted static files alike) and answers 401 before the body is parsed: an
anonymous caller learns nothing from validation errors.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from fastapi import FastAPI
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from vramtune.common.logs import log_outage
from vramtune.service.auth.hosts import TrustedHosts, allowed_names
from vramtune.service.auth.tokens import (
    LOCAL_ADMIN,
    Rule,
    dead_because,
    find_token,
    missing_scope,
    plausible_token,
    principal_of,
    rule_for,
    touch,
)
from vramtune.service.db.tables import MAX_ROW_ID, StudyRow, TrialRow
from vramtune.service.principal import Principal
from vramtune.service.settings import Settings
from vramtune.service.state import AppState

log = logging.getLogger("vramtune.auth")

ANONYMOUS = Principal(name="anonymous", scopes=frozenset())
# Path parameters that name a study, directly or through its id or one of its trials.
STUDY_NAME_PARAMS = ("name", "study_name", "study")
STUDY_ID_PARAMS = ("study_id",)
TRIAL_ID_PARAMS = ("trial_id",)
REALM = 'Bearer realm="vramtune"'


class AuthGuard:
    """Set ``request.state.principal`` and refuse with 401/403 what POLICY does not allow."""

    def __init__(self, app: ASGIApp, enabled: bool) -> None:
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.enabled:
            _set_principal(scope, LOCAL_ADMIN)
            await self.app(scope, receive, send)
            return
        refusal = await self._admit(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _admit(self, scope: Scope) -> JSONResponse | None:
        """None after setting the principal, else the refusal to send."""
        matched = match_route(scope)
        if matched is None:  # no such endpoint: the router answers 404 or 405
            _set_principal(scope, ANONYMOUS)
            return None
        rule = rule_for(scope["method"], matched[0])
        if rule.public:
            _set_principal(scope, ANONYMOUS)
            return None
        token = bearer_token(scope)
        if token is None:
            return _refuse(401, "missing bearer token (Authorization: Bearer vt_...)", REALM)
        state: AppState = scope["app"].state.vt
        sessions = state.sessions
        try:
            principal = await run_in_threadpool(authenticate, sessions, token, state.clock())
            if isinstance(principal, str):
                return _refuse(401, principal, f'{REALM}, error="invalid_token"')
            malformed = malformed_id(matched[1]) if principal.studies is not None else None
            if malformed is not None and missing_scope(principal, rule) is None:
                return JSONResponse({"detail": [malformed]}, status_code=422)
            denial = missing_scope(principal, rule) or await run_in_threadpool(
                study_denial, sessions, principal, rule, matched[1]
            )
        except SQLAlchemyError as exc:
            log_outage(log, "token check", exc)
            return _refuse(503, "database unavailable; retry later")
        if denial is not None:
            return _refuse(403, denial)
        _set_principal(scope, principal)
        return None


def _set_principal(scope: Scope, principal: Principal) -> None:
    scope.setdefault("state", {})["principal"] = principal


def _refuse(status: int, detail: str, challenge: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": challenge} if challenge else None
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def endpoints(app: Any) -> list[Any]:
    """Every route of the app with its full path, routers' prefixes included."""
    try:  # FastAPI >= 0.13x keeps included routers whole; this walks into them
        from fastapi.routing import iter_route_contexts
    except ImportError:  # older FastAPI copies included routes into app.routes
        return list(app.routes)
    return list(iter_route_contexts(app.routes))


def route_template(route: Any) -> str:
    """The path template POLICY knows a route by (a mount covers everything below it)."""
    path: str = getattr(route, "path", None) or ""
    mounted = isinstance(getattr(route, "original_route", route), Mount)
    return f"{path.rstrip('/')}/{{path:path}}" if mounted else path


def endpoint_keys(app: Any) -> list[tuple[str, str]]:
    """(method, path template) of every endpoint, as POLICY keys them (HEAD folded into GET)."""
    keys = []
    for route in endpoints(app):
        methods = getattr(route, "methods", None) or {"GET"}
        keys += [(method, route_template(route)) for method in methods if method != "HEAD"]
    return sorted(set(keys))


def match_route(scope: Scope) -> tuple[str, Mapping[str, Any]] | None:
    """The template and path parameters of the route that will serve the request, if any."""
    app = scope["app"]
    cached: list[Any] | None = getattr(app.state, "auth_endpoints", None)
    if cached is None:
        cached = app.state.auth_endpoints = endpoints(app)
    for route in cached:
        match, child_scope = route.matches(scope)
        if match == Match.FULL:
            return route_template(route), child_scope.get("path_params", {})
    return None


def bearer_token(scope: Scope) -> str | None:
    """The token of a single, well-formed ``Authorization: Bearer`` header (never the query)."""
    values: list[bytes] = [value for key, value in scope["headers"] if key == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].decode("latin-1").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not plausible_token(token):
        return None
    return token


def authenticate(sessions: sessionmaker[Session], token: str, now: datetime) -> Principal | str:
    """The principal of a live token, refreshing its last use; else why it is refused.

    Read on every request, never cached: a revocation or an expiry holds from the next call.
    """
    with sessions.begin() as session:
        row = find_token(session, token)
        if row is None:
            return "unknown token"
        dead = dead_because(row, now)
        if dead is not None:
            return dead
        touch(row, now)
        return principal_of(row)


def study_denial(
    sessions: sessionmaker[Session],
    principal: Principal,
    rule: Rule,
    path_params: Mapping[str, Any],
) -> str | None:
    """Why a study-limited principal may not use this endpoint, or None if it may."""
    if principal.studies is None or rule.studies == "none":
        return None
    limited = f"this token is limited to the studies {', '.join(sorted(principal.studies))}"
    if rule.studies == "many":
        return f"{limited} and cannot use an endpoint that spans studies"
    study = resolve_study(sessions, path_params)
    if study is None or not principal.allows_study(study):
        return f"{limited}; the study addressed is not one of them"
    return None


def resolve_study(sessions: sessionmaker[Session], path_params: Mapping[str, Any]) -> str | None:
    """The name of the study the path addresses, or None when it names none that exists."""
    for key in STUDY_NAME_PARAMS:
        if key in path_params:
            return str(path_params[key])
    query = None
    for key in STUDY_ID_PARAMS + TRIAL_ID_PARAMS:
        if key in path_params:
            number = _as_id(path_params[key])
            if number is None:
                return None
            query = select(StudyRow.name)
            if key in STUDY_ID_PARAMS:
                query = query.where(StudyRow.study_id == number)
            else:
                query = query.join(TrialRow, TrialRow.study_id == StudyRow.study_id)
                query = query.where(TrialRow.trial_id == number)
            break
    if query is None:
        return None
    with sessions() as session:
        return session.scalar(query)


def _as_id(value: Any) -> int | None:
    text = str(value)
    # ASCII digits only: "²" and other Unicode digits pass str.isdigit() but int() raises.
    if not is_decimal(text) or len(text) > 19 or int(text) > MAX_ROW_ID:
        return None
    return int(text)


def is_decimal(text: str) -> bool:
    """Whether text is a plain decimal number (ASCII 0-9 only, as int() and the routes read)."""
    return text.isascii() and text.isdigit()


def malformed_id(path_params: Mapping[str, Any]) -> dict[str, Any] | None:
    """FastAPI's 422 error entry for a path id that is no decimal number, else None.

    The route would answer the same 422 for any token; the guard says it first because it
    must read the id to find the study, and a study-limited token deserves the field's name
    rather than a 403 about a study it never named.
    """
    for key in STUDY_ID_PARAMS + TRIAL_ID_PARAMS:
        if key in path_params and not is_decimal(str(path_params[key])):
            message = "Input should be a valid integer, unable to parse string as an integer"
            return {"type": "int_parsing", "loc": ["path", key], "msg": message}
    return None


def is_loopback(host: str) -> bool:
    """Whether a listen address reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost may resolve to anything
        return False


def warn_if_exposed(host: str, auth: str) -> bool:
    """Log a warning when the server listens beyond loopback with auth off; whether it did."""
    if auth != "off" or is_loopback(host):
        return False
    log.warning(
        "listening on %s with VRAMTUNE_AUTH=off: anyone who can reach this port can create, "
        "delete and run studies; set VRAMTUNE_AUTH=on and use tokens (`vramtune token create`)",
        host,
    )
    return True


def install_auth(app: FastAPI, settings: Settings) -> None:
    """Guard every route of the app (outermost middleware); the auth routes are
    vramtune.service.app's."""
    app.add_middleware(AuthGuard, enabled=settings.auth == "on")
    if settings.auth == "off":  # outermost: a rebound page's request is answered by nothing else
        app.add_middleware(TrustedHosts, names=allowed_names(settings.allowed_hosts, settings.host))
    warn_if_exposed(settings.host, settings.auth)
