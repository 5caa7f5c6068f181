"""``vramtune token create|list|revoke`` and the first admin token of ``vramtune db upgrade``.

These are admin operations, so they work on the database directly (``--database-url``), like
``db upgrade``: whoever can reach the database owns the service anyway. Server modules are
imported inside the commands, so a worker-only install can still build the parser.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

    from vramtune.service.db.tables import TokenRow

SCOPE_NAMES = ("admin", "submit", "worker", "read")
ADMIN_TOKEN_ENV = "VRAMTUNE_ADMIN_TOKEN"


def print_first_admin_token(engine: Engine) -> None:
    """On a database without tokens, create the first admin token and print it once."""
    from vramtune.service.auth.tokens import first_admin_token
    from vramtune.service.db.engine import make_sessions
    from vramtune.service.state import utcnow

    preset = os.environ.get(ADMIN_TOKEN_ENV) or None  # set but empty: unset
    with make_sessions(engine).begin() as session:
        clear = first_admin_token(session, preset, utcnow())
    if clear is None:
        return
    if preset is not None:
        print(f"first admin token: the one in {ADMIN_TOKEN_ENV} (stored only as a hash)")
    else:
        print(f"first admin token (shown once, stored only as a hash): {clear}")


@contextmanager
def _token_session(args: argparse.Namespace) -> Iterator[Session]:
    """A transaction on the migrated database of --database-url (or the environment's)."""
    from vramtune.service.db.engine import make_engine, make_sessions
    from vramtune.service.db.migrate import require_migrated
    from vramtune.service.settings import Settings

    settings = Settings(**({"database_url": args.database_url} if args.database_url else {}))
    engine = make_engine(settings.database_url)
    try:
        require_migrated(engine)
        with make_sessions(engine).begin() as session:
            yield session
    finally:
        engine.dispose()


def _scopes(values: list[str]) -> list[str]:
    """--scope admits repeats and commas: --scope read,submit."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _listed(row: TokenRow) -> dict[str, Any]:
    from vramtune.service.auth.tokens import token_out

    return token_out(row).model_dump(mode="json")


def cmd_token_create(args: argparse.Namespace) -> int:
    """Create a token; print it (once) on stdout, its description on stderr."""
    from vramtune.common.durations import duration_of
    from vramtune.service.auth.tokens import create_token
    from vramtune.service.state import utcnow
    from vramtune.service.wire import TokenCreate

    spec = TokenCreate.model_validate(
        {
            "name": args.name,
            "scopes": _scopes(args.scope),
            "studies": args.study,
            "expires_in": args.expires,
        }
    )
    lifetime = None if spec.expires_in is None else duration_of(spec.expires_in)
    with _token_session(args) as session:
        row, clear = create_token(
            session, spec.name, spec.scopes, utcnow(), spec.studies, expires_in=lifetime
        )
        listed = _listed(row)
    if args.json:
        print(json.dumps({**listed, "token": clear}, indent=2))
        return 0
    limit = ", ".join(listed["studies"]) if listed["studies"] else "all studies"
    until = f"until {listed['expires_at']}" if listed["expires_at"] else "without expiry"
    print(
        f"created token {listed['id']} {listed['name']!r}: {', '.join(listed['scopes'])} on "
        f"{limit}, {until}; it is shown once and stored only as a hash",
        file=sys.stderr,
    )
    print(clear)
    return 0


def cmd_token_list(args: argparse.Namespace) -> int:
    """List tokens (never the tokens themselves)."""
    from vramtune.service.auth.tokens import list_tokens

    with _token_session(args) as session:
        rows = [_listed(row) for row in list_tokens(session)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from vramtune.service.cli.console import table

    headers = ["ID", "NAME", "SCOPES", "STUDIES", "CREATED", "EXPIRES", "LAST USED", "REVOKED"]
    fields = [
        "id",
        "name",
        "scopes",
        "studies",
        "created_at",
        "expires_at",
        "last_used_at",
        "revoked_at",
    ]
    print(table(headers, [[_cell(row[field]) for field in fields] for row in rows]))
    return 0


def _cell(value: Any) -> object:
    return ",".join(value) if isinstance(value, list) else value


def cmd_token_revoke(args: argparse.Namespace) -> int:
    """Revoke a token by id."""
    from vramtune.service.auth.tokens import revoke_token
    from vramtune.service.state import utcnow

    with _token_session(args) as session:
        row = revoke_token(session, args.id, utcnow())
        listed = None if row is None else _listed(row)
    if listed is None:
        print(f"vramtune: no token {args.id}", file=sys.stderr)
        return 1
    print(json.dumps(listed, indent=2) if args.json else f"revoked token {args.id}")
    return 0


def add_token_commands(subparsers: Any) -> None:
    """Add ``token create|list|revoke`` to the ``vramtune`` parser."""
    token = subparsers.add_parser("token", help="create, list and revoke API tokens")
    commands = token.add_subparsers(dest="token_command", required=True, metavar="COMMAND")
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--database-url", help="default: env VRAMTUNE_DATABASE_URL or sqlite:///./vramtune.db"
    )
    options.add_argument("--json", action="store_true", help="print JSON for scripts")
    create = commands.add_parser("create", parents=[options], help="create a token")
    create.add_argument(
        "--scope",
        action="append",
        required=True,
        help=f"{', '.join(SCOPE_NAMES)} (repeatable or comma-separated)",
    )
    create.add_argument(
        "--study", action="append", help="limit the token to this study (repeatable)"
    )
    create.add_argument("--name", default="token", help="a label for `token list`")
    create.add_argument(
        "--expires", metavar="DURATION", help="lifetime: 30d, 12h, 90m or 3600s (default: never)"
    )
    handlers: list[tuple[argparse.ArgumentParser, Callable[[argparse.Namespace], int]]] = [
        (create, cmd_token_create),
        (commands.add_parser("list", parents=[options], help="list tokens"), cmd_token_list),
    ]
    revoke = commands.add_parser("revoke", parents=[options], help="revoke a token by ID")
    revoke.add_argument("id", type=int, metavar="ID")
    handlers.append((revoke, cmd_token_revoke))
    for parser, handler in handlers:
        parser.set_defaults(func=handler)
