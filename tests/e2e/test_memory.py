"""Issue 6 end to end: resize, route to a larger card, infeasible with a constraint, OOM retry.

Cards: a small simulated card (64 MiB) and a large one (256 MiB), both with the default 10 %
margin. Quadratic footprints (worker/tasks/quadratic.py): 16 MiB fixed, 64 KiB of weights per
unit of width, 4 KiB of activations per sample and unit of width.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import optuna
import pytest
import sqlalchemy as sa

from tests.e2e.conftest import LARGE, SMALL, Studies, WorkerFactory, finished
from vramtune.service.testing import ServerProcess
from vramtune.service.wire import CardInfo, Heartbeat, WorkerRegister
from vramtune.worker.device.gpu import parse_size
from vramtune.worker.loop.api import ServerClient

# The database is part of what this tests: it runs on SQLite and PostgreSQL (tests/conftest.py).
pytestmark = pytest.mark.both_databases


def fixed(**params: Any) -> dict[str, Any]:
    """A search space that can only sample these values."""
    return {name: {"type": "categorical", "choices": [value]} for name, value in params.items()}


def test_too_big_for_the_small_card_runs_resized_with_the_sampled_effective_batch(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    # 20 MiB + 256 samples x 256 KiB = 84 MiB > 57.6 MiB: two micro-batches of 128 fit.
    name = studies.create(fixed(batch_size=256, width=64), minimize_peak_memory=True)
    worker = start_worker(fleet_server.url, SMALL)
    [trial] = studies.wait_until(name, finished(1))
    assert worker.finish() == 0
    assert trial.state == "COMPLETE", trial
    assert trial.params["batch_size"] == 256
    assert trial.plan is not None and trial.plan.micro_batch is not None
    assert trial.plan.micro_batch * trial.plan.accumulation == 256
    assert "unchanged" in trial.plan.reason
    assert trial.outcome == "resized"
    assert trial.measured_peak_bytes is not None
    assert trial.measured_peak_bytes <= parse_size(SMALL)
    assert trial.values is not None and trial.values[1] == trial.measured_peak_bytes


def test_too_big_for_the_small_card_waits_for_the_large_one(
    fleet_server: ServerProcess,
    studies: Studies,
    start_worker: WorkerFactory,
    large_card_online: ServerClient,
) -> None:
    # 16 MiB + 64 MiB of weights cannot fit 57.6 MiB at any micro-batch; 208 MiB fits 230 MiB.
    name = studies.create(fixed(batch_size=32, width=1024))
    small = start_worker(fleet_server.url, SMALL)
    small.wait_for('"event": "handed_back"')
    assert small.finish() == 0
    assert '"resolution": "waiting"' in small.logs()
    [waiting] = studies.trials(name)
    assert waiting.state not in {"COMPLETE", "FAIL"}, "it waits while a larger card is live"
    large = start_worker(fleet_server.url, LARGE)
    [trial] = studies.wait_until(name, finished(1))
    assert large.finish() == 0
    assert trial.state == "COMPLETE"
    assert trial.worker == large.name
    assert trial.card_model == f"simulated-cpu-{LARGE}"
    assert trial.outcome == "routed"
    assert trial.plan is not None and trial.plan.micro_batch is None


def test_too_big_for_every_card_is_infeasible_with_its_constraint_stored(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    workers = [start_worker(fleet_server.url, size) for size in (SMALL, LARGE)]
    for worker in workers:  # both live before the study: the small card's hand-back may wait
        worker.wait_for('"event": "registered"')
    name = studies.create(fixed(batch_size=32, width=4096))  # 256 MiB of weights alone
    [trial] = studies.wait_until(name, finished(1))
    assert [w.finish() for w in workers] == [0, 0]
    assert trial.outcome == "infeasible"
    frozen = optuna.load_study(study_name=name, storage=fleet_server.database_url).trials[0]
    constraints = frozen.system_attrs.get("constraints")
    assert constraints and max(constraints) > 0, frozen.system_attrs
    assert any(key.startswith("constraints:") for key in frozen.system_attrs)


def test_an_oom_at_run_time_is_retried_with_a_smaller_plan(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    # 36 MiB fits the small card as asked, but the run dies above micro-batches of 63.
    task_config = {"step_seconds": 0.001, "oom_above_micro_batch": 63}
    name = studies.create(fixed(batch_size=64, width=64), task_config=task_config)
    worker = start_worker(fleet_server.url, SMALL)
    [trial] = studies.wait_until(name, finished(1))
    assert worker.finish() == 0
    assert trial.state == "COMPLETE", trial
    assert trial.attempt >= 1  # attempts count from 0
    assert trial.plan is not None and (trial.plan.micro_batch, trial.plan.accumulation) == (32, 2)
    assert '"kind": "oom"' in worker.logs()
    outcomes = _observed_outcomes(fleet_server.database_url, trial.id)
    # Trial ids of deleted studies come back in SQLite; the newest two observations are ours.
    assert outcomes[-2:] == ["oom", "complete"]


def _observed_outcomes(url: str, trial_id: int) -> list[str]:
    engine = sa.create_engine(url)
    with engine.connect() as connection:
        rows = connection.execute(
            sa.text(
                "SELECT outcome FROM vramtune_memory_observations WHERE trial_id = :t ORDER BY id"
            ),
            {"t": trial_id},
        ).all()
    engine.dispose()
    return [row[0] for row in rows]


@pytest.fixture
def large_card_online(fleet_server: ServerProcess) -> Iterator[ServerClient]:
    """A live worker with the large card that asks for no work: trials may wait for it."""
    client = ServerClient(fleet_server.url)
    size = parse_size(LARGE)
    card = CardInfo(
        model=f"simulated-cpu-{LARGE}", total_bytes=size, free_bytes=size, simulated=True
    )
    registered = client.register(
        WorkerRegister(name="large-placeholder", device="cpu", card=card, tasks=["quadratic"])
    )
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(registered.heartbeat_interval_s):
            client.heartbeat(registered.worker_id, Heartbeat(free_bytes=size), retry_for_s=1.0)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    yield client
    stop.set()
    thread.join()
    client.stop_worker(registered.worker_id)
    client.close()
