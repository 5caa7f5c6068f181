"""API tokens, the caller they identify (Principal), and the one policy table of scopes.

Every endpoint of the app is listed in ``POLICY`` with the scope it needs; the guard in
``vramtune.service.auth.guard`` applies it to every request, and tests/security enumerates
``app.routes`` so that an endpoint missing from the table fails the suite. An endpoint that is
missing anyway needs ``admin``: the guard fails closed.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import Depends, Request
from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from vramtune.service.auth import audit
from vramtune.service.db.tables import TokenRow
from vramtune.service.fleet.workers import stop_token_workers
from vramtune.service.principal import SCOPES, Principal, Scope
from vramtune.service.wire import API_PREFIX, TokenOut

TOKEN_PREFIX = "vt_"  # lets secret scanners and people recognise a leaked vramtune token
MIN_TOKEN_CHARS = 32
MAX_TOKEN_CHARS = 256
# last_used_at is a hint for admins, not an audit log: refreshing it at most this often keeps
# authenticated reads from turning into writes.
LAST_USED_RESOLUTION = timedelta(minutes=1)
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


# With VRAMTUNE_AUTH=off every caller is this one.
LOCAL_ADMIN = Principal(name="local (auth off)", scopes=frozenset({"admin"}))


async def current_principal(request: Request) -> Principal:
    """The caller, as the guard (vramtune.service.auth.guard) identified it (async: no thread
    hop)."""
    principal = getattr(request.state, "principal", None)
    if not isinstance(principal, Principal):
        raise RuntimeError("vramtune.service.auth.guard.AuthGuard is not installed on this app")
    return principal


PrincipalDep = Annotated[Principal, Depends(current_principal)]


# ---------------------------------------------------------------- the policy table

# How an endpoint relates to studies, for a token limited to some studies:
# "path": the study is named by the path ({name}, {study_id} or {trial_id}) and checked;
# "none": the endpoint touches no particular study (a worker's heartbeat, whoami), allowed;
# "many": it reads or writes studies the path does not name (list, create, tokens), refused.
StudyRelation = Literal["path", "none", "many"]


@dataclass(frozen=True)
class Rule:
    """What an endpoint needs: one of ``scopes`` (none: public) and how it meets studies."""

    scopes: frozenset[str]
    studies: StudyRelation = "path"

    @property
    def public(self) -> bool:
        """Whether the endpoint needs no token at all."""
        return not self.scopes


def needs(*scopes: Scope, studies: StudyRelation = "path") -> Rule:
    """A rule satisfied by any one of ``scopes``."""
    return Rule(frozenset(scopes), studies)


PUBLIC = Rule(frozenset(), "none")
ANY_TOKEN = needs(*SCOPES, studies="none")
FAIL_CLOSED = needs("admin", studies="many")

V = API_PREFIX
POLICY: dict[tuple[str, str], Rule] = {
    # liveness probes and the API's own description carry no data
    ("GET", f"{V}/health"): PUBLIC,
    ("GET", "/openapi.json"): PUBLIC,
    ("GET", "/docs"): PUBLIC,
    ("GET", "/docs/oauth2-redirect"): PUBLIC,
    ("GET", "/redoc"): PUBLIC,
    # dashboard pages and assets carry no data: their scripts fetch it with the user's token
    ("GET", "/"): PUBLIC,
    ("GET", "/studies/{name:path}"): PUBLIC,
    ("GET", "/fleet"): PUBLIC,
    ("GET", "/dashboard/static/{name}"): PUBLIC,
    # who am I: any valid token may ask
    ("GET", f"{V}/auth/whoami"): ANY_TOKEN,
    # tokens: admin only
    ("GET", f"{V}/tokens"): needs("admin", studies="many"),
    ("POST", f"{V}/tokens"): needs("admin", studies="many"),
    ("DELETE", f"{V}/tokens/{{token_id}}"): needs("admin", studies="many"),
    ("GET", f"{V}/audit"): needs("admin", studies="many"),
    # studies: submitters create and steer them, readers watch them, only admins delete
    ("POST", f"{V}/studies"): needs("submit", studies="many"),
    ("GET", f"{V}/studies"): needs("read", studies="many"),
    ("GET", f"{V}/studies/{{name}}"): needs("read"),
    ("GET", f"{V}/studies/{{name}}/trials"): needs("read"),
    ("GET", f"{V}/studies/{{name}}/best"): needs("read"),
    ("POST", f"{V}/studies/{{name}}/pause"): needs("submit"),
    ("POST", f"{V}/studies/{{name}}/resume"): needs("submit"),
    ("DELETE", f"{V}/studies/{{name}}"): needs("admin"),
    # the worker protocol; a trial call is checked against the trial's study. `next` chooses
    # among studies itself and offers only those request.state.principal.allows_study.
    ("POST", f"{V}/workers"): needs("worker", studies="none"),
    ("POST", f"{V}/workers/{{worker_id}}/heartbeat"): needs("worker", studies="none"),
    ("POST", f"{V}/workers/{{worker_id}}/next"): needs("worker", studies="none"),
    ("POST", f"{V}/workers/{{worker_id}}/stop"): needs("worker", studies="none"),
    ("GET", f"{V}/calibration"): needs("worker", "read", studies="none"),
    ("GET", f"{V}/step-time"): needs("worker", "read", studies="none"),
    ("POST", f"{V}/trials/{{trial_id}}/start"): needs("worker"),
    ("POST", f"{V}/trials/{{trial_id}}/report"): needs("worker"),
    ("POST", f"{V}/trials/{{trial_id}}/complete"): needs("worker"),
    ("POST", f"{V}/trials/{{trial_id}}/fail"): needs("worker"),
    ("POST", f"{V}/trials/{{trial_id}}/handback"): needs("worker"),
    ("GET", f"{V}/workers"): needs("read", studies="none"),
    # the dashboard's data
    ("GET", f"{V}/dashboard/studies"): needs("read", studies="many"),
    ("GET", f"{V}/dashboard/studies/{{name:path}}"): needs("read"),
    ("GET", f"{V}/dashboard/studies/{{name:path}}/history"): needs("read"),
    ("GET", f"{V}/dashboard/studies/{{name:path}}/memory"): needs("read"),
    ("GET", f"{V}/dashboard/studies/{{name:path}}/calibration"): needs("read"),
    ("GET", f"{V}/dashboard/studies/{{name:path}}/regions"): needs("read"),
    ("GET", f"{V}/dashboard/studies/{{name:path}}/importances"): needs("read"),
    ("GET", f"{V}/dashboard/studies/{{name:path}}/pareto"): needs("read"),
    ("GET", f"{V}/dashboard/studies/{{name:path}}/advice"): needs("read"),
    ("GET", f"{V}/dashboard/studies/{{name:path}}/trials"): needs("read"),
    ("GET", f"{V}/dashboard/studies/{{name:path}}/trials/{{number}}"): needs("read"),
    ("GET", f"{V}/dashboard/fleet"): needs("read", studies="none"),
    # Prometheus scrapes with a read token (scrape_config authorization); it spans studies
    ("GET", "/metrics"): needs("read", studies="many"),
}


def rule_for(method: str, path_template: str) -> Rule:
    """The rule of an endpoint; HEAD is GET; an endpoint not in the table needs admin."""
    method = "GET" if method == "HEAD" else method
    return POLICY.get((method, path_template), FAIL_CLOSED)


def missing_scope(principal: Principal, rule: Rule) -> str | None:
    """None when the principal satisfies the rule's scope, else what the body should say."""
    if rule.public or any(principal.has_scope(scope) for scope in rule.scopes):
        return None
    wanted = " or ".join(f"'{scope}'" for scope in _ordered(rule.scopes))
    held = ", ".join(_ordered(principal.scopes)) or "none"
    return f"this endpoint needs the {wanted} scope; the token has: {held}"


def _ordered(scopes: Iterable[str]) -> list[str]:
    return sorted(scopes, key=lambda scope: SCOPES.index(scope) if scope in SCOPES else 99)


# ---------------------------------------------------------------- tokens


def new_token() -> str:
    """A fresh token: the prefix and 32 random bytes (256 bits), URL-safe."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """SHA-256 of the token, hex.

    A slow KDF (bcrypt, argon2) protects low-entropy passwords against guessing; these tokens
    carry 256 random bits, so a leaked hash cannot be brute-forced and a fast, unsalted hash is
    enough, which also lets the guard find a token by its hash with one indexed lookup.
    """
    return hashlib.sha256(token.encode()).hexdigest()


def plausible_token(token: str) -> bool:
    """Whether a presented string could be a token at all (bounds before any hashing)."""
    in_bounds = MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS
    return in_bounds and _VISIBLE_ASCII.fullmatch(token) is not None


def find_token(session: Session, token: str) -> TokenRow | None:
    """The token row of a presented token (revoked or expired ones too), or None."""
    digest = hash_token(token)
    row = session.scalars(select(TokenRow).where(TokenRow.token_hash == digest)).first()
    # The lookup is by hash, so timing reveals nothing about the token; compare_digest keeps
    # the final equality check constant-time as well.
    if row is None or not hmac.compare_digest(row.token_hash, digest):
        return None
    return row


def dead_because(row: TokenRow, now: datetime) -> str | None:
    """Why a stored token no longer admits anyone ("revoked ...", "expired ..."), or None.

    Said to whoever presents it: they hold the token, so this tells them nothing new.
    """
    if row.revoked_at is not None:
        return f"token revoked at {_stamp(row.revoked_at)}"
    if row.expires_at is not None and row.expires_at <= now:
        return f"token expired at {_stamp(row.expires_at)}"
    return None


def has_live_token(session: Session, now: datetime) -> bool:
    """Whether some token can still be used (neither revoked nor expired)."""
    query = select(TokenRow.id).where(
        TokenRow.revoked_at.is_(None),
        or_(TokenRow.expires_at.is_(None), TokenRow.expires_at > now),
    )
    return session.scalar(query.limit(1)) is not None


def principal_of(row: TokenRow) -> Principal:
    """The Principal a token row stands for."""
    studies = None if row.studies is None else frozenset(row.studies)
    return Principal(name=row.name, scopes=frozenset(row.scopes), studies=studies, token_id=row.id)


def touch(row: TokenRow, now: datetime) -> bool:
    """Refresh last_used_at when it is older than the resolution; whether it changed."""
    if row.last_used_at is not None and now - row.last_used_at < LAST_USED_RESOLUTION:
        return False
    row.last_used_at = now
    return True


def check_scopes(scopes: Sequence[str]) -> list[str]:
    """The scopes deduplicated in canonical order; ValueError naming an unknown one."""
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown:
        raise ValueError(f"unknown scope {unknown[0]!r}; scopes are {', '.join(SCOPES)}")
    if not scopes:
        raise ValueError("a token needs at least one scope")
    return _ordered(set(scopes))


def create_token(
    session: Session,
    name: str,
    scopes: Sequence[str],
    now: datetime,
    studies: Sequence[str] | None = None,
    token: str | None = None,
    expires_in: timedelta | None = None,
    by: Principal | None = None,
) -> tuple[TokenRow, str]:
    """Add a token (a fresh one unless given) and return its row and the clear token.

    The clear token exists only in the return value: the caller shows it once. ``by``: who
    creates it, for the audit log (None: the command line).
    """
    clear = token if token is not None else new_token()
    row = TokenRow(
        name=name,
        token_hash=hash_token(clear),
        scopes=check_scopes(scopes),
        studies=None if studies is None else sorted(set(studies)),
        created_at=now,
        expires_at=None if expires_in is None else now + expires_in,
    )
    session.add(row)
    session.flush()
    audited(
        session,
        "token_created",
        by,
        f"token {row.id}",
        now,
        name=name,
        scopes=row.scopes,
        studies=row.studies,
        expires_at=_stamp(row.expires_at),
    )
    return row, clear


def list_tokens(session: Session) -> list[TokenRow]:
    """Every token, revoked ones included, oldest first."""
    return list(session.scalars(select(TokenRow).order_by(TokenRow.id)))


def revoke_token(
    session: Session, token_id: int, now: datetime, by: Principal | None = None
) -> TokenRow | None:
    """Mark a token revoked (idempotent); None when there is no such token.

    The workers it registered are stopped with it (service.fleet.workers.stop_token_workers): their
    trials are offered to other workers at once rather than when their leases expire, and
    the workers' next calls get a 401 that makes them exit.
    """
    row = session.get(TokenRow, token_id)
    if row is not None and row.revoked_at is None:
        row.revoked_at = now
        stopped = stop_token_workers(session, token_id, row.revoked_at)
        audited(
            session,
            "token_revoked",
            by,
            f"token {row.id}",
            now,
            name=row.name,
            workers_stopped=stopped,
        )
    return row


def audited(
    session: Session,
    event: audit.AuditEvent,
    by: Principal | None,
    target: str,
    now: datetime,
    **detail: Any,
) -> None:
    """Record an audit event done by a principal (None: the command line) at ``now``."""
    actor = by.name if by is not None else audit.command_line_actor()
    token_id = None if by is None else by.token_id
    audit.record(session, event, actor, token_id, target, now, **detail)


def first_admin_token(session: Session, preset: str | None, now: datetime) -> str | None:
    """On a database without tokens, store an admin token and return it; else None.

    ``preset`` (VRAMTUNE_ADMIN_TOKEN) is stored (hashed) instead of a generated token.
    """
    if session.scalar(select(func.count()).select_from(TokenRow)):
        return None
    if preset is not None and not plausible_token(preset):
        raise ValueError(
            f"VRAMTUNE_ADMIN_TOKEN must be {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} ASCII "
            f"characters (use `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    _row, clear = create_token(session, "first-admin", ["admin"], now, token=preset)
    return clear


def _stamp(moment: datetime | None) -> str | None:
    return None if moment is None else f"{moment.isoformat(timespec='seconds')}Z"


def token_out(row: TokenRow) -> TokenOut:
    """The listed form of a token row (without any secret)."""
    return TokenOut.model_validate(row, from_attributes=True)
