"""`vramtune worker` and `vramtune tasks` as real subprocesses (no server needed)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from vramtune.service.testing import free_port
from vramtune.worker.cli import _child_argv, add_commands

REPO = Path(__file__).resolve().parents[2]
QUADRATIC_ONLY = ["--tasks", "vramtune.worker.tasks.quadratic", "--no-entry-points"]


def vramtune(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VRAMTUNE_")}
    return subprocess.run(
        [sys.executable, "-m", "vramtune", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=clean | env,
        check=False,
    )


def test_tasks_lists_what_a_worker_would_advertise() -> None:
    result = vramtune("tasks", *QUADRATIC_ONLY)
    assert result.returncode == 0, result.stderr
    assert "quadratic" in result.stdout
    assert "digits-mlp" not in result.stdout


def test_a_worker_needs_a_server() -> None:
    result = vramtune("worker", "--device", "cpu", "--memory-limit", "1GiB")
    assert result.returncode == 2
    assert "--server or VRAMTUNE_SERVER" in result.stderr


def test_a_cpu_worker_needs_its_simulated_cards_size() -> None:
    result = vramtune("worker", "--server", "http://127.0.0.1:9", "--device", "cpu")
    assert result.returncode == 2
    assert "--memory-limit" in result.stderr


def test_a_size_that_is_not_one_is_refused_by_name() -> None:
    result = vramtune("worker", "--device", "cpu", "--memory-limit", "lots")
    assert result.returncode == 2
    assert "--memory-limit" in result.stderr and "not a size" in result.stderr


def test_no_gpu_here_is_said_plainly() -> None:
    result = vramtune("worker", "--device", "cuda:0", *QUADRATIC_ONLY, VRAMTUNE_SERVER="http://x")
    if "NVIDIA" in result.stderr:  # a machine with a GPU got past this point
        return
    assert result.returncode == 2
    assert "no GPU cuda:0" in result.stderr


def test_a_node_of_simulated_cards_needs_the_cpu_and_a_size() -> None:
    result = vramtune("worker", "--ranks", "4", *QUADRATIC_ONLY, VRAMTUNE_SERVER="http://x")
    assert result.returncode == 2
    assert "--ranks simulates cards: use it with --device cpu --memory-limit" in result.stderr
    wrong = vramtune("worker", "--devices", "cuda:0,gpu1", *QUADRATIC_ONLY, VRAMTUNE_SERVER="x")
    assert wrong.returncode == 2 and "--devices takes distinct cuda:N cards" in wrong.stderr


def test_the_worker_commands_do_not_import_torch() -> None:
    code = "import sys, vramtune.worker.cli, vramtune.worker.loop.agent\n"
    code += "sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, check=False).returncode == 0


def test_a_worker_waits_for_its_server_and_still_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    server = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    command = [sys.executable, "-m", "vramtune", "worker", "--device", "cpu"]
    command += ["--memory-limit", "64MiB", *QUADRATIC_ONLY]
    with (tmp_path / "worker.log").open("wb") as log:
        worker = subprocess.Popen(
            command,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ | {"VRAMTUNE_SERVER": server},
        )
    deadline = time.monotonic() + 60
    while "retrying" not in (tmp_path / "worker.log").read_text():
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()
        assert time.monotonic() < deadline, "the worker never tried to register"
        time.sleep(0.1)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    assert "/workers" in (tmp_path / "worker.log").read_text()


def test_all_gpus_starts_one_worker_per_card_with_the_same_options() -> None:
    parser = argparse.ArgumentParser(prog="vramtune")
    add_commands(parser.add_subparsers(dest="command"))
    options = "--server http://s:8000 --token vt_x --all-gpus --name box --tasks my.tasks"
    args = parser.parse_args(
        ["worker", *options.split(), "--max-trials", "5", "--exit-when-idle", "30"]
    )
    argv = _child_argv(args, 3)
    assert argv[:4] == [sys.executable, "-m", "vramtune.worker.cli", "worker"]
    assert "--all-gpus" not in argv
    pairs = dict(zip(argv[4::2], argv[5::2], strict=False))
    assert pairs["--device"] == "cuda:3" and pairs["--name"] == "box-cuda3"
    assert pairs["--server"] == "http://s:8000" and pairs["--token"] == "vt_x"
    assert pairs["--tasks"] == "my.tasks" and pairs["--max-trials"] == "5"
    assert pairs["--exit-when-idle"] == "30.0"


def test_all_gpus_passes_plan_ahead_to_every_worker() -> None:
    parser = argparse.ArgumentParser(prog="vramtune")
    add_commands(parser.add_subparsers(dest="command"))
    ahead = parser.parse_args(["worker", "--server", "http://s", "--all-gpus", "--plan-ahead"])
    plain = parser.parse_args(["worker", "--server", "http://s", "--all-gpus"])
    assert "--plan-ahead" in _child_argv(ahead, 0)
    assert "--plan-ahead" not in _child_argv(plain, 0)
