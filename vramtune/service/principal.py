"""Who is calling (Principal) and what each scope grants: below both the fleet and auth.

The guard (vramtune.service.auth.guard) builds a Principal for every request; routing
(vramtune.service.fleet.routing) builds one from a worker's stored token to ask whether that
worker may lease a study, which it could not do from auth/ (auth imports the fleet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Scope = Literal["admin", "submit", "worker", "read"]
SCOPES: tuple[Scope, ...] = ("admin", "submit", "worker", "read")
# What each scope grants: admin implies everything; a submitter may watch what it submits.
GRANTS: dict[str, frozenset[str]] = {
    "admin": frozenset(SCOPES),
    "submit": frozenset({"submit", "read"}),
    "worker": frozenset({"worker"}),
    "read": frozenset({"read"}),
}


@dataclass(frozen=True)
class Principal:
    """Who is calling: set by the guard as ``request.state.principal`` on every request.

    ``studies`` is None for a token valid for every study, else the study names it is limited
    to; routes that choose among studies themselves (a worker's ``next``) must offer only
    studies for which ``allows_study`` is true.
    """

    name: str
    scopes: frozenset[str]
    studies: frozenset[str] | None = None
    token_id: int | None = None

    def has_scope(self, scope: str) -> bool:
        """Whether one of the principal's scopes grants ``scope``."""
        return any(scope in GRANTS.get(own, frozenset()) for own in self.scopes)

    def allows_study(self, study: str) -> bool:
        """Whether the principal may touch the study of this name."""
        return self.studies is None or study in self.studies
