"""The one ``vramtune`` entry point: a parser that each package adds its commands to.

Commands come from the ``vramtune.commands`` entry-point group (pyproject.toml): each entry is a
function ``add(subparsers)`` that adds its subcommands, each setting ``func(args) -> exit code``.
The service registers serve, db, study, token and demo; the worker package registers worker and
tasks. Neither package imports the other's command line, and a worker-only install gets
``vramtune worker`` without FastAPI or a database driver.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

import yaml

from vramtune.service.cli.console import print_api_error
from vramtune.service.cli.quiet import quiet_third_party
from vramtune.service.client import ApiError

COMMAND_GROUP = "vramtune.commands"
DEFAULT_SERVER = "http://127.0.0.1:8000"
Handler = Callable[[argparse.Namespace], int]


def client_options() -> argparse.ArgumentParser:
    """--server/--token/--json, accepted before or after the subcommand."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--server",
        default=argparse.SUPPRESS,
        help=f"server URL (env VRAMTUNE_SERVER, default {DEFAULT_SERVER})",
    )
    parent.add_argument("--token", default=argparse.SUPPRESS, help="API token (env VRAMTUNE_TOKEN)")
    parent.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON for scripts"
    )
    return parent


def build_parser() -> argparse.ArgumentParser:
    """The full parser: the root options and every registered package's commands."""
    parser = argparse.ArgumentParser(
        prog="vramtune", description="Memory-aware hyperparameter tuning."
    )
    parser.add_argument(
        "--server", default=None, help=f"server URL (env VRAMTUNE_SERVER, default {DEFAULT_SERVER})"
    )
    parser.add_argument("--token", default=None, help="API token (env VRAMTUNE_TOKEN)")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    registered = sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name)
    if not registered:
        raise RuntimeError(
            f"no {COMMAND_GROUP} entry points: vramtune is not installed (pip install -e .)"
        )
    for entry in registered:
        entry.load()(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vramtune`` console script."""
    import httpx

    quiet_third_party()  # before any command imports torch or a task file

    args = build_parser().parse_args(argv)
    handler: Handler = args.func
    try:
        return handler(args)
    except ApiError as exc:
        print_api_error(exc)
        return 1
    except httpx.TransportError as exc:
        print(f"vramtune: cannot reach the server: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"vramtune: {exc}", file=sys.stderr)
        return 1
