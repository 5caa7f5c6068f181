"""A user's Hugging Face Trainer (examples/hf_trainer) tuned end to end: a real server (SQLite
and PostgreSQL), a real `vramtune worker` process loading the example with ``--tasks``, on a
simulated card too small for the batch as asked."""

from __future__ import annotations

import importlib.util

import pytest

from tests.e2e.conftest import REPO, Studies, WorkerFactory, finished, observed_peaks
from vramtune.service.testing import ServerProcess
from vramtune.worker.device.gpu import parse_size

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("accelerate") is None,
    reason="needs vramtune[hf]",
)

EXAMPLE = REPO / "examples" / "hf_trainer" / "tasks.py"
# The example's GPT-2 at 16 windows of 32 characters needs ~11 MB as asked and 6.8 MB in
# micro-batches of 8: with the 10 % margin only the resized plan fits 8 MiB.
CARD = "8MiB"
PATIENCE_S = 300.0  # the worker imports torch and transformers and traces before it trains


def test_a_trainer_study_runs_resized_through_the_trainers_knobs(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    space = {
        "per_device_train_batch_size": {"type": "categorical", "choices": [16]},
        "learning_rate": {"type": "float", "low": 1e-4, "high": 3e-3, "log": True},
        "n_layer": {"type": "categorical", "choices": [2]},
    }
    name = studies.create(
        space,
        task="hf-trainer-gpt2",
        task_config={},
        budget={"max_steps": 4, "eval_every": 2},
    )
    worker = start_worker(fleet_server.url, CARD, "--tasks", str(EXAMPLE))
    [trial] = studies.wait_until(name, finished(1), timeout=PATIENCE_S)
    assert worker.finish() == 0
    assert trial.state == "COMPLETE", trial
    assert trial.outcome == "resized"
    assert trial.plan is not None and trial.plan.micro_batch is not None
    # The effective batch, a hyperparameter, is kept: per-device batch x accumulation.
    assert trial.plan.micro_batch * trial.plan.accumulation == 16
    assert trial.values is not None and 0 < trial.values[0] < 10  # eval_loss in nats
    assert set(trial.intermediate) >= {2}  # reported by the TrainerCallback
    measured, predicted = trial.measured_peak_bytes, trial.predicted_peak_bytes
    assert measured is not None and predicted is not None
    assert measured <= parse_size(CARD)
    assert abs(predicted - measured) <= 0.001 * measured
    # The Trainer's evaluation was traced and metered apart: the observation carries both.
    peaks = observed_peaks(fleet_server.database_url, trial.id)
    assert None not in peaks.values(), peaks
    assert peaks["predicted_training"] == peaks["measured_training"]
    assert peaks["predicted_evaluation"] == peaks["measured_evaluation"]


def test_the_pruner_stops_a_trainer_trial_through_its_callback(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    # eval_loss starts near ln(128) = 4.85: a threshold of 0.5 prunes at the first report.
    space = {"per_device_train_batch_size": {"type": "categorical", "choices": [8]}}
    name = studies.create(
        space,
        task="hf-trainer-gpt2",
        task_config={},
        pruner={"name": "threshold", "args": {"upper": 0.5}},
        budget={"max_steps": 40, "eval_every": 2},
    )
    worker = start_worker(fleet_server.url, "64MiB", "--tasks", str(EXAMPLE))
    [trial] = studies.wait_until(name, finished(1), timeout=PATIENCE_S)
    assert worker.finish() == 0
    assert trial.state == "PRUNED", trial
    assert trial.outcome == "pruned"
    assert list(trial.intermediate) == [2]  # stopped at the first evaluation, not at step 40
