"""`vramtune worker` and `vramtune tasks`: the worker's command line.

`add_commands(subparsers)` is registered in the `vramtune.commands` entry-point group
(pyproject.toml), which service/cli/parser.py loads; nothing here imports torch (or the tasks)
before a command runs, so `vramtune --help` stays fast on a server.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from vramtune.common.logs import LogFormat, add_log_format_option, configure_logging
from vramtune.common.stopping import positive_int, stop_on_signals
from vramtune.worker.device import gpu

if TYPE_CHECKING:
    from vramtune.service.wire import CardInfo
    from vramtune.worker.trial.runner import TrialRunner

log = logging.getLogger("vramtune.worker")


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `worker` and `tasks` commands; each sets `func(args) -> exit code`."""
    worker = subparsers.add_parser(
        "worker",
        help="run a worker: pull trials from a server and run them on one card",
        description="Pull trials from a vramtune server, predict their peak memory, run them "
        "(as asked or resized) or hand them back, and report what they measured.",
    )
    worker.add_argument(
        "--server",
        default=os.environ.get("VRAMTUNE_SERVER"),
        help="server URL, e.g. http://tuner:8000 (env VRAMTUNE_SERVER)",
    )
    worker.add_argument(
        "--token",
        default=os.environ.get("VRAMTUNE_TOKEN"),
        help="API token with the worker scope (env VRAMTUNE_TOKEN)",
    )
    worker.add_argument("--device", default="cuda:0", help="cuda:N or cpu (default cuda:0)")
    worker.add_argument(
        "--memory-limit",
        type=_size,
        help="with --device cpu: the simulated card's memory (e.g. 2GiB); on a GPU: a cap",
    )
    _add_tasks_option(worker)
    worker.add_argument("--name", help="worker name (default: host-device)")
    worker.add_argument(
        "--all-gpus", action="store_true", help="start one worker process per GPU of this machine"
    )
    worker.add_argument(
        "--node",
        action="store_true",
        help="with --all-gpus: one node worker over every GPU (trials of studies with a "
        "distributed policy may span its cards) instead of one worker per GPU",
    )
    worker.add_argument(
        "--devices",
        metavar="cuda:0,cuda:1,...",
        help="a node worker over these GPUs: trials side by side on disjoint cards, one process "
        "per rank (NCCL) for a trial on several",
    )
    worker.add_argument(
        "--ranks",
        type=positive_int,
        metavar="N",
        help="with --device cpu: a node of N simulated cards of --memory-limit each (gloo ranks)",
    )
    worker.add_argument(
        "--max-trials", type=int, metavar="N", help="exit after N trials (bounded runs, CI)"
    )
    worker.add_argument(
        "--max-trials-per-card",
        type=positive_int,
        default=1,
        metavar="N",
        help="run up to N trials at once on the card, each in its own process limited to its "
        "predicted peak plus the margin, for studies whose memory policy allows packing "
        "(default 1: one trial at a time; a node worker runs one trial per card instead)",
    )
    worker.add_argument(
        "--plan-ahead",
        action="store_true",
        help="lease and plan the next trial while one trains (planning off the card's time)",
    )
    worker.add_argument(
        "--exit-when-idle",
        type=float,
        metavar="SECONDS",
        help="exit once the server has had no work for this long",
    )
    worker.add_argument(
        "--poll", type=float, default=1.0, metavar="SECONDS", help="wait between empty asks"
    )
    worker.add_argument(
        "--spool",
        type=Path,
        metavar="DIR",
        help="keep each trial's final call in DIR until the server answers it, and send what an "
        "earlier run left there at start (one DIR per worker process)",
    )
    # JSON by default: worker logs are read by tools (and tests) as one event per line.
    add_log_format_option(worker, default="json")
    worker.set_defaults(func=worker_command)

    tasks = subparsers.add_parser("tasks", help="list the tasks a worker here would advertise")
    _add_tasks_option(tasks)
    tasks.set_defaults(func=tasks_command)
    check = tasks.add_subparsers(dest="tasks_command").add_parser(
        "check",
        help="check a task file against the Task contract before any trial runs",
        description="Load FILE as a worker would, name any member a task class lacks and the "
        "rule it keeps, then (with --study or --config) build, train, evaluate and trace each "
        "task on one small configuration. Exits 1 when a rule is broken.",
    )
    check.add_argument("file", metavar="FILE", help="a .py file or a dotted module of tasks")
    given = check.add_mutually_exclusive_group()
    given.add_argument(
        "--study", metavar="STUDY", help="a study file: its smallest configuration is checked"
    )
    given.add_argument("--config", metavar="JSON", help="a configuration, e.g. '{\"width\": 8}'")
    check.add_argument("--device", default="cpu", help="where real steps run (default: cpu)")
    check.set_defaults(func=tasks_check_command)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m vramtune.worker.cli worker ...`: the worker commands without the server's CLI."""
    parser = argparse.ArgumentParser(prog="vramtune")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


def worker_command(args: argparse.Namespace) -> int:
    """Run one worker (or, with --all-gpus, one per card) until SIGTERM/SIGINT."""
    _configure_logging(args.log_format)
    if not args.server:
        print("vramtune worker: --server or VRAMTUNE_SERVER is required", file=sys.stderr)
        return 2
    try:
        args.node_devices = node_devices(args)
    except ValueError as error:
        print(f"vramtune worker: {error}", file=sys.stderr)
        return 2
    if args.all_gpus and not args.node:
        return _run_all_gpus(args)
    if args.node_devices:
        args.device = args.node_devices[0]
    return _run_one(args)


def node_devices(args: argparse.Namespace) -> tuple[str, ...]:
    """A node worker's cards, one per rank, from --devices, --ranks or --all-gpus --node;
    empty for a one-card worker. ValueError names the option that is wrong."""
    if args.devices:
        devices = tuple(d.strip() for d in args.devices.split(",") if d.strip())
        wrong = [d for d in devices if not re.fullmatch(r"cuda:\d{1,4}", d)]
        if wrong or len(set(devices)) != len(devices):
            raise ValueError(f"--devices takes distinct cuda:N cards, got {args.devices!r}")
        return devices
    if args.max_trials_per_card > 1 and (args.devices or args.ranks is not None or args.node):
        # A node runs its trials side by side on disjoint cards (vramtune/worker/loop/node.py).
        raise ValueError("--max-trials-per-card packs one card; a node runs one trial per card")
    if args.ranks is not None:
        if args.device != "cpu" or not args.memory_limit:
            raise ValueError("--ranks simulates cards: use it with --device cpu --memory-limit")
        return ("cpu",) * int(args.ranks)
    if args.node and not args.all_gpus:
        raise ValueError("--node goes with --all-gpus")
    if args.node:
        count = gpu.gpu_count()
        if count == 0:
            raise ValueError("--all-gpus --node: NVML sees no GPU")
        return tuple(f"cuda:{index}" for index in range(count))
    return ()


def tasks_command(args: argparse.Namespace) -> int:
    """Print the task names a worker would advertise, and the modules that failed to load."""
    from vramtune.worker.tasks.registry import discover, format_listing

    found = discover(args.tasks, entry_points=not args.no_entry_points)
    print(format_listing(found))
    return 0 if found.runners else 1


def tasks_check_command(args: argparse.Namespace) -> int:
    """Report what FILE's classes lack, then each task's contract checks on one configuration."""
    from vramtune.worker.tasks.check_file import check_file

    report, code = check_file(args.file, study=args.study, config=args.config, device=args.device)
    print(report)
    return code


def _run_one(args: argparse.Namespace) -> int:
    # First: a SIGTERM while the tasks import (torch takes seconds) must still end cleanly.
    # The agent finishes its step and hands its trial back.
    stop = stop_on_signals(log, "stopping after the current step")
    from vramtune.worker.tasks.registry import discover

    try:
        info = gpu.card_for_device(args.device, args.memory_limit)
    except gpu.DeviceError as error:
        print(f"vramtune worker: {error}", file=sys.stderr)
        return 2
    found = discover(args.tasks, entry_points=not args.no_entry_points)
    for source, problem in found.errors.items():
        log.error("task %s not loaded: %s", source, problem)
    for name, missing in found.unavailable.items():
        log.info("task %s not advertised: %s", name, missing)
    if not found.runners:
        print("vramtune worker: no task to advertise", file=sys.stderr)
        return 2
    warming: threading.Thread | None = None
    warm_up: Callable[[threading.Event], bool] | None = None
    if (
        "vramtune.worker.run.training" in sys.modules
    ):  # a torch task turned up (the registry imported it)
        from vramtune.worker.predictor import wait_for_warm_up, warm_up_in_background
        from vramtune.worker.tasks.warm import warm_up_workloads

        # The first trace in a process costs ~2 s more (10-15 s at load 5): pay it while the
        # agent registers, and let the agent wait for it before its first lease, so that no
        # trial's plan choice pays it.
        warming = warm_up_in_background(warm_up_workloads())
        warm_up = wait_for_warm_up
    try:
        return _run_agent(args, found.runners, info, stop, warm_up)
    finally:
        if warming is not None:
            # A worker that needed no trace (its predictions came from the fleet) may finish
            # first: torch aborts the process (std::terminate) if the thread still traces then.
            warming.join()


def _run_agent(
    args: argparse.Namespace,
    runners: Mapping[str, TrialRunner],
    info: CardInfo,
    stop: threading.Event,
    warm_up: Callable[[threading.Event], bool] | None = None,
) -> int:
    from vramtune.worker.loop.agent import Agent
    from vramtune.worker.loop.api import Rejected, ServerClient, ServerUnavailable
    from vramtune.worker.loop.cycle import AgentOptions
    from vramtune.worker.tasks.registry import Discovered
    from vramtune.worker.trial.runner import CardSpec

    card = CardSpec(info=info, constants=_card_constants(args.device), device=args.device)
    options = AgentOptions(
        name=args.name or default_name(args.device),
        device=args.device,
        memory_limit=args.memory_limit,
        max_trials=args.max_trials,
        exit_when_idle_s=args.exit_when_idle,
        idle_poll_s=args.poll,
        spool_dir=args.spool,
        plan_ahead=args.plan_ahead,
        max_trials_per_card=args.max_trials_per_card,
        runner_source=Discovered(tuple(args.tasks), entry_points=not args.no_entry_points),
        devices=tuple(getattr(args, "node_devices", ())),
        warm_up=warm_up,
    )
    if stop.is_set():
        return 0
    agent = Agent(ServerClient(args.server, args.token), runners, card, options, stop)
    try:
        agent.run_forever(stop)
    except Rejected as error:
        print(f"vramtune worker: the server refused: {error}", file=sys.stderr)
        return 2
    except ServerUnavailable as error:
        print(f"vramtune worker: {error}", file=sys.stderr)
        return 1
    return 0


def _run_all_gpus(args: argparse.Namespace) -> int:
    """One child worker per GPU; signals are passed on and the worst exit code returned."""
    count = gpu.gpu_count()
    if count == 0:
        print("vramtune worker --all-gpus: NVML sees no GPU", file=sys.stderr)
        return 2
    children = [subprocess.Popen(_child_argv(args, index)) for index in range(count)]

    def forward(signum: int, frame: FrameType | None) -> None:
        for child in children:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return max(child.wait() for child in children)


def _child_argv(args: argparse.Namespace, index: int) -> list[str]:
    argv = [sys.executable, "-m", "vramtune.worker.cli", "worker", "--server", args.server]
    argv += ["--device", f"cuda:{index}", "--poll", str(args.poll)]
    argv += ["--name", f"{args.name or default_name('')}-cuda{index}".replace("--", "-")]
    if args.token:
        argv += ["--token", args.token]
    if args.memory_limit:
        argv += ["--memory-limit", str(args.memory_limit)]
    for module in args.tasks:
        argv += ["--tasks", module]
    if args.no_entry_points:
        argv.append("--no-entry-points")
    if args.max_trials is not None:
        argv += ["--max-trials", str(args.max_trials)]
    if args.exit_when_idle is not None:
        argv += ["--exit-when-idle", str(args.exit_when_idle)]
    argv += ["--max-trials-per-card", str(args.max_trials_per_card)]
    if args.spool is not None:
        argv += ["--spool", str(args.spool / f"cuda{index}")]
    if args.plan_ahead:
        argv.append("--plan-ahead")
    argv += ["--log-format", args.log_format]
    return argv


def _card_constants(device: str) -> dict[str, int]:
    """Memory the trace cannot see, measured on a real card (nothing on a simulated one)."""
    if device == "cpu":
        return {}
    from vramtune.worker.predictor import measure_card_constants  # imports torch: a GPU worker only

    return dict(measure_card_constants(device).model_dump())


def default_name(device: str) -> str:
    """host-device, reduced to the characters a worker name may hold."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{socket.gethostname()}-{device}").strip("-._")
    return (name or "worker")[:128]


def _add_tasks_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tasks",
        action="append",
        default=[],
        metavar="MODULE",
        help="also load tasks from this module or .py file (repeatable)",
    )
    parser.add_argument(
        "--no-entry-points",
        action="store_true",
        help="only the --tasks modules, not the installed vramtune.tasks entry points",
    )


def _size(text: str) -> int:
    try:
        return gpu.parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _configure_logging(log_format: LogFormat) -> None:
    configure_logging(os.environ.get("VRAMTUNE_LOG_LEVEL", "INFO"), log_format)
    # httpx logs every request at INFO; the agent logs what matters.
    logging.getLogger("httpx").setLevel(logging.WARNING)


if __name__ == "__main__":
    sys.exit(main())
