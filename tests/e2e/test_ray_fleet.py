"""Issue 33: `vramtune ray up` on a real local Ray cluster, two simulated cards, both databases.

Cost: one Ray head for the module (`ray start --head`, ~5-10 s here), then per test and
database one `vramtune ray up` (two actors, each a `vramtune worker` on the quadratic task) and
a study of a few seconds: about two minutes for the module on a 2-core machine (load 8-25).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import LARGE, PATIENCE_S, REPO, SMALL, Studies, finished
from vramtune.service.testing import ServerProcess, free_port
from vramtune.service.wire import TrialOut, WorkerList
from vramtune.worker.device.gpu import gpu_count

pytest.importorskip("ray", reason="the ray extra (pip install -e '.[ray]')")

CARDS = (SMALL, LARGE)
WORKER_OPTIONS = (
    "--tasks",
    "vramtune.worker.tasks.quadratic",
    "--no-entry-points",
    "--poll",
    "0.1",
)
# For the head, `ray up` and this process: a token of the module's own (not ~/.ray/auth_token),
# and loopback addresses only (Ray otherwise swaps 127.0.0.1 for the machine's address).
RAY_ENV = {
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": uuid.uuid4().hex,
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_DEDUP_LOGS": "0",
}


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """A one-node Ray cluster on 127.0.0.1 with 4 CPUs, the machine's GPUs (NVML's count) and
    a small object store; its address."""
    port = free_port()
    # A short temp dir: Ray's socket paths must stay under 108 characters.
    temp_dir = tempfile.mkdtemp(prefix="vt-ray-")
    ray_cli = str(Path(sys.executable).with_name("ray"))
    command = [ray_cli, "start", "--head", "--block", f"--port={port}"]
    command += ["--node-ip-address=127.0.0.1", "--num-cpus=4", f"--num-gpus={gpu_count()}"]
    command += ["--include-dashboard=false", f"--temp-dir={temp_dir}"]
    command += ["--memory=2000000000", "--object-store-memory=100000000", "--disable-usage-stats"]
    env = {**os.environ, **RAY_ENV}
    head = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    address = f"127.0.0.1:{port}"
    try:
        _wait_for_port(port, head)
        yield address
    finally:
        head.send_signal(signal.SIGTERM)  # --block: the head takes its raylet and GCS with it
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


class RayUp:
    """`vramtune ray up` as a real subprocess, its output (the actors' too) in a log file."""

    def __init__(
        self, address: str, server: str, log_path: Path, device: str = "cpu", *options: str
    ) -> None:
        """Simulated CARDS on `device` cpu; on cuda, one actor per GPU of the cluster."""
        self.prefix = f"ray{uuid.uuid4().hex[:6]}"
        self.log_path = log_path
        command = [sys.executable, "-m", "vramtune", "ray", "up", "--address", address]
        command += ["--server", server, "--device", device, "--name", self.prefix]
        for card in CARDS if device == "cpu" else ():
            command += ["--memory-limit", card]
        command += ["--poll", "0.5", "--grace", "30", *options, "--", *WORKER_OPTIONS]
        env = {**os.environ, **RAY_ENV, "PYTHONUNBUFFERED": "1"}
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env
            )

    def worker_name(self, card: str) -> str:
        """The worker (and actor) name of a card: one actor per card, in CARDS order."""
        return f"{self.prefix}-{CARDS.index(card)}"

    def logs(self) -> str:
        """Everything it (and its actors) wrote so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM: the fleet stops its workers (each hands back) and exits."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(PATIENCE_S)


@pytest.fixture
def ray_up(
    ray_head: str, fleet_server: ServerProcess, tmp_path: Path
) -> Iterator[Callable[[], RayUp]]:
    """ray_up() -> RayUp, once both its workers are live on the server; stopped after."""
    started: list[RayUp] = []

    def start() -> RayUp:
        fleet = RayUp(ray_head, fleet_server.url, tmp_path / "ray-up.log")
        started.append(fleet)
        _wait_for_live_workers(fleet_server, fleet, len(CARDS))
        return fleet

    yield start
    for fleet in started:
        code = fleet.stop()
        print(f"----- ray up\n{fleet.logs()[-12000:]}")
        assert code == 0, "ray up stops cleanly on SIGTERM"


def test_a_study_completes_on_two_ray_actors_with_resized_and_routed_trials(
    fleet_server: ServerProcess, studies: Studies, ray_up: Callable[[], RayUp]
) -> None:
    fleet = ray_up()
    # Seed 7 samples widths 1024, 1024, 64, 64. Width 1024 (80 MiB before activations) never
    # fits the small card: whichever of the first two trials the small card asks for is handed
    # back and routed to the large one, which is busy with the other. Width 64 at batch 1024
    # (276 MiB as asked) fits neither card as asked: it runs resized wherever it lands.
    name = studies.create(
        {
            "width": {"type": "categorical", "choices": [64, 1024]},
            "batch_size": {"type": "categorical", "choices": [1024]},
        },
        n_trials=4,
        sampler={"name": "random", "args": {"seed": 7}},
        budget={"max_steps": 20, "eval_every": 10},
        task_config={"step_seconds": 0.02},
    )
    trials = studies.wait_until(name, finished(4), timeout=3 * PATIENCE_S)
    assert [t.params["width"] for t in trials] == [1024, 1024, 64, 64], "seed 7's draws"
    assert [t.state for t in trials] == ["COMPLETE"] * 4
    outcomes = {t.number: t.outcome for t in trials}
    assert "routed" in outcomes.values(), outcomes
    assert outcomes[2] == outcomes[3] == "resized", outcomes
    large = fleet.worker_name(LARGE)
    routed = [t for t in trials if t.outcome == "routed"]
    assert all(t.worker == large and t.card_model == f"simulated-cpu-{LARGE}" for t in routed)
    assert {t.worker for t in trials} == {fleet.worker_name(SMALL), large}, "both actors worked"


def test_a_killed_actor_is_restarted_and_its_trial_reoffered_once(
    fleet_server: ServerProcess, studies: Studies, ray_up: Callable[[], RayUp], ray_head: str
) -> None:
    fleet = ray_up()
    # Three seconds a trial, fits both cards as asked.
    name = studies.create(
        {"width": {"type": "categorical", "choices": [64]}},
        n_trials=3,
        budget={"max_steps": 150, "eval_every": 50},
        task_config={"step_seconds": 0.02},
    )
    doomed = fleet.worker_name(SMALL)
    [victim] = [t for t in studies.wait_until(name, _running_on(doomed)) if _on(t, doomed)]
    _kill_actor(ray_head, doomed)  # as a lost node would: Ray restarts it
    trials = studies.wait_until(name, finished(3), timeout=3 * PATIENCE_S)
    _wait_for(lambda: sum(w.name == doomed for w in _workers(fleet_server).workers) == 2)
    assert [t.state for t in trials] == ["COMPLETE"] * 3, "nothing lost"
    [again] = [t for t in trials if t.number == victim.number]
    # Re-offered once: by the reaper (attempt + 1), or handed back when the worker saw the
    # SIGTERM its dying actor sends it before Ray's SIGKILL (same attempt).
    assert again.attempt in {victim.attempt, victim.attempt + 1}
    # The wait above: Ray restarted the actor, and with it a worker of the same name.


def _kill_actor(address: str, name: str) -> None:
    """`ray.kill` from a driver of its own (Ray reads its settings at import: not in pytest)."""
    script = (
        "import sys, ray; ray.init(address=sys.argv[1], namespace='vramtune'); "
        "ray.kill(ray.get_actor(sys.argv[2]), no_restart=False)"
    )
    env = {**os.environ, **RAY_ENV}
    subprocess.run([sys.executable, "-c", script, address, name], env=env, check=True, timeout=120)


def _running_on(worker: str) -> Callable[[list[TrialOut]], bool]:
    return lambda trials: any(_on(t, worker) for t in trials)


def _on(trial: TrialOut, worker: str) -> bool:
    return trial.state == "RUNNING" and trial.worker == worker


def _workers(server: ServerProcess) -> WorkerList:
    response = httpx.get(f"{server.url}/api/v1/workers", timeout=30)
    assert response.status_code == 200, response.text
    return WorkerList.model_validate(response.json())


def _wait_for_live_workers(server: ServerProcess, fleet: RayUp, count: int) -> None:
    """Until `count` live workers carry the fleet's names (registered, heartbeating)."""
    deadline = time.monotonic() + PATIENCE_S
    while True:
        live = {w.name for w in _workers(server).workers if w.state == "live"}
        if len({n for n in live if n.startswith(f"{fleet.prefix}-")}) >= count:
            return
        if fleet.process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the fleet's workers never came up:\n{fleet.logs()[-6000:]}")
        time.sleep(0.2)


def _wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("never happened")
        time.sleep(0.2)


def _wait_for_port(port: int, head: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline and head.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"the Ray head never listened on {port} (exit {head.poll()})")


def test_the_pool_grows_to_the_pending_trials_and_shrinks_as_workers_go_idle(
    ray_head: str, fleet_server: ServerProcess, studies: Studies, tmp_path: Path
) -> None:
    from vramtune.worker.engines.ray_fleet import pending_trials

    sizing = ("--size-to-pending", "--workers", "2", "--idle-exit", "2")
    fleet = RayUp(ray_head, fleet_server.url, tmp_path / "ray-up.log", "cpu", *sizing)
    try:
        name = studies.create({"x": {"type": "float", "low": 0.0, "high": 1.0}}, n_trials=3)
        assert pending_trials(fleet_server.url, None) == 3
        _wait_for_live_workers(fleet_server, fleet, 2)  # 3 pending, at most 2
        studies.wait_until(name, finished(3))
        assert pending_trials(fleet_server.url, None) == 0
        _wait_for(lambda: fleet.logs().count("exited by itself") == 2)
        assert fleet.process.poll() is None, "the fleet waits for the next study"
        assert fleet.logs().count("started actor") == 2, "no actor started for no work"
    finally:
        assert fleet.stop() == 0, fleet.logs()[-6000:]


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() == 0, reason="needs a GPU (bench/gpu_check.sh runs it)")
def test_on_gpus_each_actor_runs_a_worker_on_a_card_of_its_own(
    ray_head: str, fleet_server: ServerProcess, tmp_path: Path
) -> None:
    fleet = RayUp(ray_head, fleet_server.url, tmp_path / "ray-up.log", device="cuda")
    try:
        _wait_for_live_workers(fleet_server, fleet, gpu_count())
        mine = [w for w in _workers(fleet_server).workers if w.name.startswith(fleet.prefix)]
        # Ray gave each actor one card (CUDA_VISIBLE_DEVICES): each worker's cuda:0 is another.
        assert len({w.card.uuid for w in mine}) == gpu_count() == len(mine)
        assert all(not w.card.model.startswith("simulated") for w in mine)
    finally:
        assert fleet.stop() == 0, fleet.logs()[-6000:]
