"""Issue 35: a worker warms its predictor before it leases its first trial.

The first trace in a process pays torch's one-time fake-tensor set-up (10-15 s at load 5). A
worker with a torch task starts that warm-up as it starts and waits for it after registering,
before its first lease, so the first trial's plan choice (and lease) never pays it.
"""

from __future__ import annotations

import json
from typing import Any

from tests.e2e.conftest import Studies, WorkerFactory, WorkerProcess, finished
from vramtune.service.testing import ServerProcess

# A digits CNN that runs as asked on a 64 MiB card (tests/e2e/test_fleet_predictions.py).
SHAPE = {"width": 16, "depth": 2, "resolution": 32, "batch_size": 64, "seed": 0}


def test_a_torch_worker_is_warm_before_its_first_lease(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    name = studies.create(
        {"lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}},
        task="digits-cnn",
        directions=["maximize"],
        task_config=SHAPE,
        budget={"max_steps": 2, "eval_every": 1},
    )
    worker = start_worker(
        fleet_server.url, "64MiB", "--tasks", "vramtune.worker.tasks.digits", "--max-trials", "1"
    )
    assert worker.wait() == 0
    [trial] = studies.wait_until(name, finished(1))
    assert trial.state == "COMPLETE"
    names = [e["event"] for e in events(worker)]
    assert names.index("registered") < names.index("warmed_up") < names.index("leased")
    [warmed] = [e for e in events(worker) if e["event"] == "warmed_up"]
    assert warmed["stopped"] is False and warmed["waited_s"] >= 0


def test_a_worker_without_a_torch_task_has_nothing_to_warm(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    name = studies.create({"x": {"type": "float", "low": -1.0, "high": 1.0}})
    worker = start_worker(fleet_server.url, "64MiB", "--max-trials", "1")
    assert worker.wait() == 0
    studies.wait_until(name, finished(1))
    names = [e["event"] for e in events(worker)]
    assert "leased" in names and "warmed_up" not in names


def events(worker: WorkerProcess) -> list[dict[str, Any]]:
    """The worker's structured events (JSON lines with an "event"; other loggers' lines too)."""
    lines = [json.loads(line) for line in worker.logs().splitlines() if line.startswith("{")]
    return [line for line in lines if "event" in line]
