"""Issue 29 item 2 end to end: the Lightning example (examples/lightning/: an unchanged
LightningModule + LightningDataModule, the wrapping lines of tasks.py, a study file) on a real
server (SQLite and PostgreSQL) and a real `vramtune worker` process on a simulated card too
small to run the trial as asked: it runs resized through `accumulate_grad_batches`, the
validation metric reaches the study through the reporting callback, and the measured peak is
the predicted one."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("lightning")

from tests.e2e.conftest import Studies, WorkerFactory, finished, observed_peaks
from vramtune.service.testing import ServerProcess
from vramtune.worker.device.gpu import parse_size, simulated_card
from vramtune.worker.trial.runner import CardSpec, plan_for_micro_batch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning"
# Activations dominate at this size: the whole batch needs far more than a quarter of it.
PARAMS = {"width": 256, "batch_size": 1024, "lr": 0.001}
DEPTH = 3
RESIZED_MICRO = 256
MARGIN = 0.1  # the study's default memory margin


def _example_study() -> dict[str, Any]:
    study: dict[str, Any] = yaml.safe_load((EXAMPLE / "digits-lightning.yaml").read_text())
    return study


def _predicted_peak(micro: int) -> int:
    """The trace's peak for PARAMS at `micro`, in this process (as the worker will trace it)."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        from tasks import digits_lightning
    finally:
        sys.path.remove(str(EXAMPLE))
    config = {**PARAMS, "depth": DEPTH}
    plan = plan_for_micro_batch(PARAMS["batch_size"], micro)
    card = CardSpec(info=simulated_card(parse_size("8GiB")))
    return digits_lightning.predict(config, plan, card).peak_allocated_bytes


def test_the_lightning_example_runs_resized_on_a_real_worker(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    example = _example_study()
    as_asked, resized = _predicted_peak(PARAMS["batch_size"]), _predicted_peak(RESIZED_MICRO)
    assert resized < as_asked * (1 - MARGIN)
    # The card holds the resized plan within the margin, not the batch as asked.
    card_bytes = int(resized / (1 - MARGIN)) + 64 * 1024
    assert as_asked > card_bytes * (1 - MARGIN)
    space = {name: {"type": "categorical", "choices": [value]} for name, value in PARAMS.items()}
    name = studies.create(
        space,
        task=example["task"],
        directions=example["directions"],
        metric_names=example["metric_names"],
        task_config={"depth": DEPTH},
        budget={"max_steps": 4, "eval_every": 2},
    )
    worker = start_worker(fleet_server.url, str(card_bytes), "--tasks", str(EXAMPLE / "tasks.py"))
    [trial] = studies.wait_until(name, finished(1), timeout=300)
    assert worker.finish() == 0
    assert trial.state == "COMPLETE", trial.user_attrs
    assert trial.outcome == "resized"
    assert trial.plan is not None and trial.plan.micro_batch is not None
    assert trial.plan.micro_batch * trial.plan.accumulation == PARAMS["batch_size"]
    assert PARAMS["batch_size"] % trial.plan.micro_batch == 0  # whole loader batches
    # The callback reported validation (every eval_every x accumulation loader batches, at
    # Lightning's global step: an epoch's end steps on a partial accumulation).
    assert trial.intermediate and all(0.0 <= v <= 1.0 for v in trial.intermediate.values())
    assert trial.values is not None and 0.0 <= trial.values[0] <= 1.0
    assert trial.measured_peak_bytes is not None
    assert trial.measured_peak_bytes <= card_bytes
    # The worker's prediction is calibrated by the fleet's history; the raw trace is exact.
    assert trial.measured_peak_bytes == _predicted_peak(trial.plan.micro_batch)
    # The validation was traced and metered apart: the observation carries both peaks.
    peaks = observed_peaks(fleet_server.database_url, trial.id)
    assert None not in peaks.values(), peaks
    assert peaks["predicted_training"] == peaks["measured_training"]
    # An epoch of this example is not a whole number of accumulation windows: a validation
    # falls inside one, beside its gradients, which the trace keeps. Measured: one 512 B block
    # over (2,717,184 predicted, 2,716,672 measured), the safe side.
    over = peaks["predicted_evaluation"] - peaks["measured_evaluation"]
    assert 0 <= over <= 0.001 * peaks["measured_evaluation"], peaks


def test_the_studys_pruner_stops_a_lightning_run_through_the_callback(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    example = _example_study()
    # Accuracy is never above 2: the threshold pruner prunes at the first report.
    space = {"width": {"type": "categorical", "choices": [32]}}
    name = studies.create(
        space,
        task=example["task"],
        directions=example["directions"],
        metric_names=example["metric_names"],
        task_config={"depth": 2, "batch_size": 32, "lr": 0.001},
        pruner={"name": "threshold", "args": {"lower": 2.0}},
        budget={"max_steps": 40, "eval_every": 2},
    )
    worker = start_worker(fleet_server.url, "256MiB", "--tasks", str(EXAMPLE / "tasks.py"))
    [trial] = studies.wait_until(name, finished(1), timeout=300)
    assert worker.finish() == 0
    assert trial.state == "PRUNED", trial.user_attrs
    assert trial.outcome == "pruned"
    assert sorted(trial.intermediate) == [2]  # stopped at its first report, not at step 40
