"""`vramtune ray up`: a fleet of workers as Ray actors, one per card.

`add_commands(subparsers)` is registered in the `vramtune.commands` entry-point group
(pyproject.toml); Ray is imported only when the command runs (`pip install "vramtune[ray]"`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from vramtune.common.logs import add_log_format_option, configure_logging
from vramtune.common.stopping import positive_int, stop_on_signals

if TYPE_CHECKING:
    from vramtune.worker.engines.process import WorkerSpec
    from vramtune.worker.engines.ray_fleet import FleetOptions

log = logging.getLogger("vramtune.engines")


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `ray up`; it sets `func(args) -> exit code`."""
    ray = subparsers.add_parser("ray", help="run workers as actors of a Ray cluster")
    commands = ray.add_subparsers(dest="ray_command", required=True, metavar="COMMAND")
    up = commands.add_parser(
        "up",
        help="start one worker actor per card of a Ray cluster and keep them running",
        description="Start `vramtune worker` processes as Ray actors, one per GPU (or per "
        "simulated CPU card), restart those that die, and on SIGTERM/SIGINT stop them so that "
        "each hands its trial back. Further worker options go after `--`.",
    )
    up.add_argument(
        "--address",
        default=os.environ.get("RAY_ADDRESS", "auto"),
        help="Ray cluster to join: HOST:PORT of its head, or auto (env RAY_ADDRESS)",
    )
    up.add_argument(
        "--server",
        default=os.environ.get("VRAMTUNE_SERVER"),
        help="vramtune server URL the workers pull from (env VRAMTUNE_SERVER)",
    )
    up.add_argument(
        "--token",
        default=os.environ.get("VRAMTUNE_TOKEN"),
        help="token with the worker scope (env VRAMTUNE_TOKEN); sent to actors, not on argv",
    )
    up.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda: one actor per GPU (num_gpus=1); cpu: simulated cards, one per --memory-limit",
    )
    up.add_argument(
        "--memory-limit",
        action="append",
        default=[],
        metavar="SIZE",
        help="with --device cpu: a simulated card's memory, repeatable (one kind of card each); "
        "with cuda: a cap on every card",
    )
    up.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help="actors to start (default: the cluster's GPUs, or one per --memory-limit on cpu); "
        "with --size-to-pending, the most to grow to",
    )
    up.add_argument(
        "--cpus-per-worker", type=float, default=1.0, metavar="N", help="Ray CPUs per actor"
    )
    up.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="times Ray restarts a dead actor and its worker (default 3)",
    )
    up.add_argument(
        "--grace",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="on stop, how long a worker may take to hand its trial back (default 60)",
    )
    up.add_argument(
        "--name",
        default="vramtune",
        help="actors and workers are named NAME-0, NAME-1... (Ray namespace vramtune)",
    )
    up.add_argument(
        "--size-to-pending",
        action="store_true",
        help="grow the fleet to the trials the running studies still need (at most --workers); "
        "its workers exit after --idle-exit seconds without work",
    )
    up.add_argument(
        "--idle-exit", type=float, default=60.0, metavar="SECONDS", help="see --size-to-pending"
    )
    up.add_argument(
        "--read-token",
        default=os.environ.get("VRAMTUNE_READ_TOKEN"),
        help="with --size-to-pending: a token with the read scope (default --token)",
    )
    up.add_argument(
        "--poll", type=float, default=2.0, metavar="SECONDS", help="how often actors are checked"
    )
    up.add_argument(
        "worker_options",
        nargs=argparse.REMAINDER,
        help="after --: options for every `vramtune worker` (e.g. -- --tasks mymodule)",
    )
    add_log_format_option(up, default="text")
    up.set_defaults(func=ray_up_command)


def ray_up_command(args: argparse.Namespace) -> int:
    """Join the Ray cluster, start the fleet, run it until SIGTERM/SIGINT, then stop it."""
    configure_logging(os.environ.get("VRAMTUNE_LOG_LEVEL", "INFO"), args.log_format)
    problem = _check(args)
    if problem:
        print(f"vramtune ray up: {problem}", file=sys.stderr)
        return 2
    try:
        import ray
    except ImportError:
        print('vramtune ray up: no Ray here (pip install "vramtune[ray]")', file=sys.stderr)
        return 2
    from vramtune.worker.engines.ray_fleet import RayFleet, pending_trials

    ray.init(address=args.address, namespace="vramtune", logging_level=logging.WARNING)
    # After ray.init, which installs a SIGTERM handler of its own.
    stop = stop_on_signals(log, "stopping the fleet")
    try:
        resources: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
        workers = args.workers or _default_workers(args, resources)
        if workers == 0:
            print("vramtune ray up: the cluster has no GPU (--device cpu simulates cards)")
            return 2
        fleet = RayFleet(_cards(args), _options(args, workers))
        read_token = args.read_token or args.token
        fleet.run(stop, target=lambda: pending_trials(args.server, read_token))
    finally:
        ray.shutdown()
    return 0


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line, before anything starts."""
    from vramtune.worker.device.gpu import parse_size

    if not args.server:
        return "--server or VRAMTUNE_SERVER is required"
    if args.device == "cpu" and not args.memory_limit:
        return "--device cpu needs --memory-limit SIZE (one per simulated card)"
    if args.device == "cuda" and len(args.memory_limit) > 1:
        return "--device cuda takes at most one --memory-limit (a cap on every card)"
    for size in args.memory_limit:
        try:
            parse_size(size)
        except ValueError as error:
            return str(error)
    return None


def _default_workers(args: argparse.Namespace, resources: dict[str, float]) -> int:
    if args.device == "cpu":
        return len(args.memory_limit)
    return int(resources.get("GPU", 0))


def _cards(args: argparse.Namespace) -> list[WorkerSpec]:
    """One spec per kind of card: every simulated size, or the one GPU spec."""
    from vramtune.worker.engines.process import WorkerSpec

    given = args.worker_options
    options = tuple(given[1:] if given[:1] == ["--"] else given)
    limits = args.memory_limit or [None]  # cpu: one or more (checked); cuda: a cap or none
    device = "cpu" if args.device == "cpu" else "cuda:0"  # Ray sets CUDA_VISIBLE_DEVICES
    return [
        WorkerSpec(args.server, device, limit, token=args.token, options=options)
        for limit in limits
    ]


def _options(args: argparse.Namespace, workers: int) -> FleetOptions:
    from vramtune.worker.engines.ray_fleet import FleetOptions

    return FleetOptions(
        workers=workers,
        num_gpus=0.0 if args.device == "cpu" else 1.0,
        num_cpus=args.cpus_per_worker,
        max_restarts=args.max_restarts,
        grace_s=args.grace,
        poll_s=args.poll,
        name=args.name,
        size_to_pending=args.size_to_pending,
        idle_exit_s=args.idle_exit,
    )
