"""`vramtune demo`: the whole system on one machine, on the embedded SQLite default.

Starts a service (auth off, loopback), two CPU workers with simulated cards of different sizes,
submits an example study (the character Transformer by default), and prints progress until the
study's trials (its budget, or ``--trials``) are done, then exits 0 (1 when any trial failed);
``--keep-serving`` keeps the dashboard up after that until Ctrl-C. Every piece is a real process
talking REST, as in production. Stopping sends SIGTERM to the workers (they hand their trials
back) and the server; the study stays in the database file, so running the demo again continues
it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import yaml

from vramtune.service.client import ApiError, Client
from vramtune.service.wire import StudySummary, TrialOut

PLANNING_STEP_S = 10

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"  # the checkout's examples/
DEFAULT_STUDY = EXAMPLES / "char-transformer.yaml"
CARDS = (("small", "64MiB"), ("large", "256MiB"))


@dataclass
class Fleet:
    """The demo's child processes, stopped in reverse order of start."""

    url: str
    server: subprocess.Popen[bytes]
    workers: list[subprocess.Popen[bytes]]

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM the workers (they hand back their trials), then the server."""
        _terminate(self.workers, timeout_s)
        _terminate([self.server], timeout_s)


def _terminate(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _vramtune(*args: str) -> list[str]:
    return [sys.executable, "-m", "vramtune", *args]


def _start_fleet(database_url: str, port: int, log_dir: Path, tasks: Sequence[str]) -> Fleet:
    env = {**os.environ, "VRAMTUNE_AUTH": "off", "VRAMTUNE_DATABASE_URL": database_url}
    subprocess.run(_vramtune("db", "upgrade"), env=env, check=True, capture_output=True)
    server = subprocess.Popen(
        _vramtune("serve", "--host", "127.0.0.1", "--port", str(port)),
        env=env,
        stdout=(log_dir / "server.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, server)
    task_args = [arg for module in tasks for arg in ("--tasks", module)]
    workers = [
        subprocess.Popen(
            _vramtune(
                "worker",
                "--server",
                url,
                "--device",
                "cpu",
                "--memory-limit",
                size,
                "--name",
                f"demo-{name}",
                *task_args,
            ),
            env=env,
            stdout=(log_dir / f"worker-{name}.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        for name, size in CARDS
    ]
    return Fleet(url, server, workers)


def _wait_healthy(url: str, server: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    with Client(url, timeout_s=2.0) as client:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode}; see server.log")
            try:
                client.health()
                return
            except (ApiError, httpx.HTTPError):
                time.sleep(0.3)
    raise RuntimeError(f"the server did not answer at {url} within {timeout_s:.0f} s")


def _submit(client: Client, spec: dict[str, Any], n_trials: int | None) -> StudySummary:
    if n_trials is not None:
        spec = {**spec, "n_trials": n_trials}
    try:
        return client.create_study(spec)
    except ApiError as exc:
        if exc.status != 409:
            raise
        print(f"study {spec['name']!r} is already in the database: continuing it")
        return client.resume(spec["name"])


def _all_trials(client: Client, name: str) -> list[TrialOut]:
    trials: list[TrialOut] = []
    while True:
        page = client.trials(name, offset=len(trials), limit=500)
        trials.extend(page.trials)
        if not page.trials or len(trials) >= page.total:
            return trials


def progress_line(summary: StudySummary, trials: Sequence[TrialOut], now: datetime) -> str:
    """One line of progress: trials by state and memory outcome, the workers' plan-choice time
    (median over the trials that recorded one), the best value so far, and the trials a worker
    is planning now (a long plan would otherwise look like a hung demo)."""
    outcomes = Counter(t.outcome for t in trials if t.outcome)
    done = summary.counts.get("COMPLETE", 0)
    best = "-" if summary.best_value is None else f"{summary.best_value:.4g}"
    planning = [t.planning_s for t in trials if t.planning_s is not None]
    planned = f"{statistics.median(planning):.2f} s" if planning else "-"
    line = (
        f"trials {done}/{summary.n_trials} complete, {summary.counts.get('RUNNING', 0)} running,"
        f" {summary.counts.get('FAIL', 0)} failed, {summary.counts.get('PRUNED', 0)} pruned |"
        f" resized {outcomes['resized']}, routed {outcomes['routed']},"
        f" infeasible {outcomes['infeasible']}, oom {outcomes['oom']} |"
        f" plan choice median {planned} | best {best}"
    )
    return line + "".join(
        f" | {planning_words(t.number, now - t.planning_since)}"
        for t in trials
        if t.planning_since is not None
    )


def planning_words(number: int, planning: timedelta) -> str:
    """'planning trial 3', then its time in steps of PLANNING_STEP_S (the line is printed when
    it changes: a new line every few seconds of a long plan, not every poll)."""
    seconds = int(planning.total_seconds()) // PLANNING_STEP_S * PLANNING_STEP_S
    return f"planning trial {number}" + (f": {seconds} s" if seconds > 0 else "")


def _watch(
    client: Client, name: str, stop: threading.Event, keep_serving: bool
) -> tuple[bool, StudySummary | None]:
    """Print progress until the study is done (then until Ctrl-C if keep_serving); whether it
    was done, and its last summary."""
    last = ""
    announced_done = False
    summary: StudySummary | None = None
    while not stop.is_set():
        summary = client.get_study(name)
        line = progress_line(summary, _all_trials(client, name), datetime.now(UTC))
        if line != last:
            print(line, flush=True)
            last = line
        if summary.state == "done" and not announced_done:
            announced_done = True
            if not keep_serving:
                return True, summary
            print("study done; the dashboard stays up until Ctrl-C (--keep-serving)", flush=True)
        stop.wait(2.0)
    return announced_done, summary


def demo_exit(done: bool, counts: Mapping[str, int] | None, keep_serving: bool) -> tuple[int, str]:
    """The demo's exit code and its last words: 0 when the trials are done and none failed;
    1 when some failed (a demo that lost trials did not show what it should, and a script or
    CI running it must see that) or when it was stopped before the trials were done (Ctrl-C is
    a stop the user asked for, but not a finished demo)."""
    failed = (counts or {}).get("FAIL", 0)
    if failed:
        total = sum((counts or {}).values())
        return 1, f"{failed} of {total} trials failed: see their errors on the dashboard"
    if done or keep_serving:
        return 0, ""
    return 1, "stopped before the trials were done"


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo as the CLI's `demo` command."""
    spec = yaml.safe_load(Path(args.study).read_text())
    database_url = f"sqlite:///{Path(args.database).resolve()}"
    log_dir = Path(args.log_dir).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    fleet = _start_fleet(database_url, args.port or _free_port(), log_dir, args.tasks)
    url = fleet.url
    try:
        with Client(url) as client:
            summary = _submit(client, spec, args.trials)
            print(f"vramtune demo: study {summary.name!r} on {database_url}")
            print(f"dashboard: {url}/studies/{summary.name}   fleet: {url}/fleet   logs: {log_dir}")
            done, last = _watch(client, summary.name, stop, args.keep_serving)
    finally:
        print("stopping workers and server ...", flush=True)
        fleet.stop()
    print(f"the study is kept in {args.database}; run the demo again to continue it")
    code, words = demo_exit(done, None if last is None else last.counts, args.keep_serving)
    if words:
        print(f"vramtune demo: {words}", file=sys.stderr)
    return code


def add_demo_command(subparsers: Any) -> None:
    """Register `vramtune demo`."""
    demo = subparsers.add_parser(
        "demo", help="run a service, two CPU workers and an example study on this machine"
    )
    demo.add_argument("--study", default=str(DEFAULT_STUDY), help="study file (YAML or JSON)")
    demo.add_argument("--database", default="vramtune-demo.db", help="SQLite file to keep it in")
    demo.add_argument("--port", type=int, default=8000, help="server port (0: any free port)")
    demo.add_argument("--trials", type=int, help="override the study's trial budget")
    demo.add_argument("--tasks", action="append", default=[], help="extra task module(s)")
    demo.add_argument("--log-dir", default="vramtune-demo-logs", help="where process logs go")
    demo.add_argument(
        "--keep-serving",
        action="store_true",
        help="keep the server, workers and dashboard up after the trials are done, until Ctrl-C",
    )
    # The default since issue 35; kept so that existing scripts and CI commands still run.
    demo.add_argument(
        "--exit-when-done",
        action="store_false",
        dest="keep_serving",
        help="exit once the trials are done (the default; undoes --keep-serving)",
    )
    demo.set_defaults(func=run_demo, keep_serving=False)
