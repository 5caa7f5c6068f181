"""Who am I, and the admin's token endpoints (create, list, revoke)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from service.api.deps import SessionDep
from service.api.errors import NotFound
from service.auth import tokens as auth
from service.auth.tokens import PrincipalDep
from service.db.tables import TokenRow
from service.wire import TokenCreate, TokenCreated, TokenList, TokenOut, WhoAmI

router = APIRouter(tags=["auth"])
TokenId = Annotated[int, Path(ge=1, le=2**63 - 1, description="The token's id.")]


def token_out(row: TokenRow) -> TokenOut:
    """The listed form of a token row (without any secret)."""
    return TokenOut.model_validate(row, from_attributes=True)


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
def create_token(body: TokenCreate, session: SessionDep) -> TokenCreated:
    """A new token, shown in clear in this answer only."""
    row, clear = auth.create_token(session, body.name, body.scopes, body.studies)
    return TokenCreated(**token_out(row).model_dump(), token=clear)


@router.delete("/tokens/{token_id}")
def revoke_token(token_id: TokenId, session: SessionDep) -> TokenOut:
    """Revoke a token: it stops working at once; revoking twice is harmless."""
    row = auth.revoke_token(session, token_id)
    if row is None:
        raise NotFound(f"token {token_id} not found")
    return token_out(row)
