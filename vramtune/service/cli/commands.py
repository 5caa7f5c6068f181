"""The service's commands: serve, db upgrade, and study ... over REST.

Server modules are imported inside the commands that need them, so that a worker-only install
runs ``vramtune worker`` without FastAPI or a database driver.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from vramtune.common.logs import configure_logging, json_logging_config
from vramtune.service.cli import parser
from vramtune.service.cli.console import emit_json, show_study, study_rows, trial_rows
from vramtune.service.client import Client
from vramtune.service.wire import ParetoFront

# ---------------------------------------------------------------- serve and db

KEEP_ALIVE_MIN_S = 5  # uvicorn's default


def _settings(args: argparse.Namespace) -> Any:
    from pydantic import ValidationError

    from vramtune.service.settings import Settings

    names = ("host", "port", "database_url", "log_level", "log_format", "processes")
    given = {k: getattr(args, k, None) for k in names}
    try:
        return Settings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:  # one line per bad setting, not pydantic's report
        problems = [
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors()
        ]
        raise ValueError("invalid settings: " + "; ".join(problems)) from None


NO_TOKENS = (
    "auth is on and the database holds no live API token: run `vramtune db upgrade` (it prints "
    "the first admin token) or `vramtune token create --scope admin`; for a loopback-only demo "
    "set VRAMTUNE_AUTH=off"
)


def refusal_to_serve(settings: Any, insecure: bool) -> str | None:
    """Why the server must not start with these settings (one line), or None."""
    from vramtune.service.auth.guard import is_loopback
    from vramtune.service.auth.tokens import has_live_token
    from vramtune.service.db.engine import make_engine, make_sessions
    from vramtune.service.db.migrate import NotMigrated, require_migrated
    from vramtune.service.state import utcnow

    if settings.auth == "off" and not is_loopback(settings.host) and not insecure:
        return (
            f"VRAMTUNE_AUTH=off on {settings.host} lets anyone who reaches the port run and "
            "delete studies: listen on 127.0.0.1, set VRAMTUNE_AUTH=on, or pass --insecure"
        )
    engine = make_engine(settings.database_url)
    try:
        require_migrated(engine)
        if settings.auth == "on":
            with make_sessions(engine)() as session:
                return None if has_live_token(session, utcnow()) else NO_TOKENS
    except NotMigrated as exc:
        return f"{exc}{' (it prints the first admin token)' if settings.auth == 'on' else ''}"
    finally:
        engine.dispose()
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the server with uvicorn, after checking the database is migrated and guarded."""
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    from vramtune.service.app import create_app

    settings = _settings(args)
    refusal = refusal_to_serve(settings, args.insecure)
    if refusal is not None:
        print(f"vramtune: {refusal}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    log_config: dict[str, Any] = LOGGING_CONFIG
    factory = "vramtune.service.app:create_app"
    if settings.log_format == "json":
        # Uvicorn's and Optuna's records through the root handler too: every line is JSON
        # (uvicorn applies log_config in each of its processes, the factory runs in each).
        log_config = json_logging_config(settings.log_level)
        factory = "vramtune.service.cli.commands:app_with_json_logs"
        _optuna_logs_to_root()
    if settings.processes > 1:
        # Each process builds its app from the environment: hand it these settings there.
        os.environ.update(settings.as_environment())
        app: Any = factory
        processes: dict[str, Any] = {"factory": True, "workers": settings.processes}
    else:
        app, processes = create_app(settings), {}
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=log_config,
        access_log=settings.access_log,
        timeout_keep_alive=keep_alive_s(settings),
        **proxy_options(settings),
        **processes,
    )
    return 0


def proxy_options(settings: Any) -> dict[str, Any]:
    """Uvicorn's proxy-header options: on only for the proxies the operator named.

    Uvicorn reads X-Forwarded-For from 127.0.0.1 by default, and on a loopback server every
    caller, a rebound web page's included, is 127.0.0.1: it could name any client address.
    """
    proxies = str(settings.trusted_proxies).strip()
    if not proxies:
        return {"proxy_headers": False}
    return {"proxy_headers": True, "forwarded_allow_ips": proxies}


def keep_alive_s(settings: Any) -> int:
    """How long an idle keep-alive connection stays open: past two heartbeat periods.

    Uvicorn's default (5 s) equals the heartbeat period, so a worker's connection was often
    closed between two heartbeats and each of those paid a new TCP connection (measured:
    about one heartbeat in five of 256 workers reconnected).
    """
    period: float = settings.heartbeat_interval_s
    return max(KEEP_ALIVE_MIN_S, math.ceil(2 * period) + 5)


def _optuna_logs_to_root() -> None:
    import optuna

    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()


def app_with_json_logs() -> Any:
    """The app of one server process whose logs are JSON (Optuna's own handler removed)."""
    from vramtune.service.app import create_app

    _optuna_logs_to_root()
    return create_app()


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    """Create or upgrade Optuna's and vramtune's tables."""
    from vramtune.service.cli.tokens import print_first_admin_token
    from vramtune.service.db.engine import make_engine
    from vramtune.service.db.migrate import current_revision, upgrade

    settings = _settings(args)
    engine = make_engine(settings.database_url)
    try:
        upgrade(engine)
        revision = current_revision(engine)
        print_first_admin_token(engine)
    finally:
        engine.dispose()
    print(f"{engine.url.render_as_string(hide_password=True)} is at revision {revision}")
    return 0


# ---------------------------------------------------------------- study commands


def _client(args: argparse.Namespace) -> Client:
    server = args.server or os.environ.get("VRAMTUNE_SERVER") or parser.DEFAULT_SERVER
    token = args.token or os.environ.get("VRAMTUNE_TOKEN")
    return Client(server, token=token)


def _load_spec(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())  # YAML is a superset of JSON
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a study spec is a mapping, got {type(data).__name__}")
    return data


def cmd_study_create(args: argparse.Namespace) -> int:
    """Create a study from a YAML or JSON file."""
    with _client(args) as client:
        summary = client.create_study(_load_spec(Path(args.file)))
    emit_json(summary) if args.json else print(f"created study {summary.name} (id {summary.id})")
    for warning in summary.warnings:  # on stderr, so --json output stays one document
        print(f"vramtune: warning: {warning}", file=sys.stderr)
    return 0


def cmd_study_list(args: argparse.Namespace) -> int:
    """List studies."""
    with _client(args) as client:
        studies = client.list_studies()
    emit_json(list(studies)) if args.json else print(study_rows(studies))
    return 0


def cmd_study_show(args: argparse.Namespace) -> int:
    """Show one study."""
    with _client(args) as client:
        summary = client.get_study(args.name)
    emit_json(summary) if args.json else print(show_study(summary))
    return 0


def cmd_study_trials(args: argparse.Namespace) -> int:
    """List a study's trials."""
    with _client(args) as client:
        page = client.trials(
            args.name, states=args.state or (), offset=args.offset, limit=args.limit
        )
    emit_json(page) if args.json else print(trial_rows(page.trials))
    return 0


def cmd_study_best(args: argparse.Namespace) -> int:
    """Show the best trial or the Pareto front."""
    with _client(args) as client:
        front: ParetoFront = client.best(args.name)
    emit_json(front) if args.json else print(trial_rows(front.trials))
    return 0


def _state_change(action: str) -> parser.Handler:
    def run(args: argparse.Namespace) -> int:
        with _client(args) as client:
            summary = client.pause(args.name) if action == "pause" else client.resume(args.name)
        emit_json(summary) if args.json else print(f"study {summary.name} is {summary.state}")
        return 0

    run.__doc__ = f"{action.capitalize()} a study."
    return run


def cmd_study_delete(args: argparse.Namespace) -> int:
    """Delete a study."""
    with _client(args) as client:
        client.delete(args.name)
    print(json.dumps({"deleted": args.name}) if args.json else f"deleted study {args.name}")
    return 0


# ---------------------------------------------------------------- registration


def _add_study_commands(subparsers: Any) -> None:
    client_options = parser.client_options()
    study = subparsers.add_parser("study", help="create, list and manage studies over REST")
    commands = study.add_subparsers(dest="study_command", required=True, metavar="COMMAND")
    create = commands.add_parser(
        "create", parents=[client_options], help="create a study from FILE.yaml|json"
    )
    create.add_argument("file", metavar="FILE")
    create.set_defaults(func=cmd_study_create)
    commands.add_parser("list", parents=[client_options], help="list studies").set_defaults(
        func=cmd_study_list
    )
    named: list[tuple[str, str, parser.Handler]] = [
        ("show", "show a study", cmd_study_show),
        ("best", "best trial or Pareto front", cmd_study_best),
        ("pause", "stop handing out trials", _state_change("pause")),
        ("resume", "hand out trials again", _state_change("resume")),
        ("delete", "delete a study and its trials", cmd_study_delete),
        ("trials", "list a study's trials", cmd_study_trials),
    ]
    for name, help_text, handler in named:
        command = commands.add_parser(name, parents=[client_options], help=help_text)
        command.add_argument("name", metavar="NAME")
        command.set_defaults(func=handler)
        if name == "trials":
            command.add_argument(
                "--state", action="append", help="only this TrialState (repeatable)"
            )
            command.add_argument("--offset", type=int, default=0)
            command.add_argument("--limit", type=int, default=100)


def _add_server_commands(subparsers: Any) -> None:
    serve = subparsers.add_parser("serve", help="run the server")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--database-url", help="default: env VRAMTUNE_DATABASE_URL or sqlite:///./vramtune.db"
    )
    serve.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="json: one JSON object per line; text: 'event key=value ...' "
        "(env VRAMTUNE_LOG_FORMAT, default text)",
    )
    serve.add_argument(
        "--insecure",
        action="store_true",
        help="allow VRAMTUNE_AUTH=off on an address other than loopback",
    )
    serve.add_argument(
        "--processes", type=int, help="server processes (PostgreSQL only; env VRAMTUNE_PROCESSES)"
    )
    serve.set_defaults(func=cmd_serve)
    db = subparsers.add_parser("db", help="database schema")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="COMMAND")
    upgrade = db_commands.add_parser("upgrade", help="create or upgrade every table")
    upgrade.add_argument("--database-url")
    upgrade.set_defaults(func=cmd_db_upgrade)


def add_commands(subparsers: Any) -> None:
    """The server's commands (serve, db) and the study commands over REST."""
    _add_server_commands(subparsers)
    _add_study_commands(subparsers)
