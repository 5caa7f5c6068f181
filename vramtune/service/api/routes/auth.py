"""Who am I, and the admin's endpoints: tokens (create, list, revoke) and the audit log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from vramtune.common.durations import duration_of
from vramtune.service.api.deps import NowDep, SessionDep, path_id, query_id
from vramtune.service.auth import audit, tokens as auth
from vramtune.service.auth.tokens import PrincipalDep, token_out
from vramtune.service.errors import NotFound
from vramtune.service.wire import (
    AuditOut,
    AuditPage,
    TokenCreate,
    TokenCreated,
    TokenList,
    TokenOut,
    WhoAmI,
)

router = APIRouter(tags=["auth"])
TokenId = Annotated[int, path_id("The token's id.")]


@router.get("/auth/whoami")
def whoami(principal: PrincipalDep) -> WhoAmI:
    """The caller's name, scopes and the studies it is limited to (null: all)."""
    studies = None if principal.studies is None else sorted(principal.studies)
    scopes = auth.check_scopes(list(principal.scopes))
    return WhoAmI.model_validate({"name": principal.name, "scopes": scopes, "studies": studies})


@router.get("/tokens")
def list_tokens(session: SessionDep) -> TokenList:
    """Every token, revoked ones included; never the tokens themselves."""
    return TokenList(tokens=[token_out(row) for row in auth.list_tokens(session)])


@router.post("/tokens", status_code=201)
def create_token(
    body: TokenCreate, session: SessionDep, principal: PrincipalDep, now: NowDep
) -> TokenCreated:
    """A new token, shown in clear in this answer only."""
    lifetime = None if body.expires_in is None else duration_of(body.expires_in)
    row, clear = auth.create_token(
        session, body.name, body.scopes, now, body.studies, expires_in=lifetime, by=principal
    )
    return TokenCreated(**token_out(row).model_dump(), token=clear)


@router.delete("/tokens/{token_id}")
def revoke_token(
    token_id: TokenId, session: SessionDep, principal: PrincipalDep, now: NowDep
) -> TokenOut:
    """Revoke a token: it stops working at once, as do the workers it registered (their
    trials are offered again); revoking twice is harmless."""
    row = auth.revoke_token(session, token_id, now, by=principal)
    if row is None:
        raise NotFound(f"token {token_id} not found")
    return token_out(row)


@router.get("/audit")
def audit_log(
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    before: Annotated[
        int | None, query_id("Events older than this one (its id): the next page.")
    ] = None,
) -> AuditPage:
    """Token creations and revocations, study deletions, pauses and resumes, newest first."""
    rows = audit.recent(session, limit, before)
    return AuditPage(events=[AuditOut.model_validate(row, from_attributes=True) for row in rows])
