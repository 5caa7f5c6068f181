"""Issue 29, "evaluation is part of the footprint", end to end: a real server (SQLite and
PostgreSQL) and real workers on 64 MiB simulated cards running `examples/my_task.py`, whose
`evaluate` runs the whole held-out set in one forward pass: one runs three small warm-up
trials, a second the ~40 MiB configuration (the fleet's correction needs two workers' runs).

Before, the evaluation was measured but never predicted: three small warm-up runs measured
2.7-4.6x their prediction, the calibration turned that constant into a x3.6-4.9 scale, and a
configuration predicted and measured at about 40 MiB was ended infeasible on the 64 MiB card.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from tests.e2e.conftest import SMALL, Studies, WorkerFactory, finished
from vramtune.service.testing import ServerProcess
from vramtune.service.wire import API_PREFIX, Calibration
from vramtune.worker.device.gpu import parse_size

MY_TASK = Path(__file__).parents[2] / "examples" / "my_task.py"
BUDGET = {"max_steps": 4, "eval_every": 2}
# About 40 MiB on the CPU card, set by the training step (batch 512); the configuration.
WIDE = {"width": 6600, "batch_size": 512}


def wine_study(studies: Studies, widths: list[int], batch_size: int, n_trials: int) -> str:
    """A study of the wine task over these widths at one batch size."""
    space = {
        "width": {"type": "categorical", "choices": widths},
        "batch_size": {"type": "categorical", "choices": [batch_size]},
    }
    body = {"task": "wine-mlp", "task_config": {}, "n_trials": n_trials, "budget": BUDGET}
    body |= {"directions": ["maximize"], "metric_names": ["accuracy"]}
    return studies.create(space, **body)


def served_calibration(server: ServerProcess) -> Calibration:
    """The calibration the server serves the worker's card for the wine task."""
    query = {
        "card_model": f"simulated-cpu-{SMALL}",
        "torch_version": torch.__version__,
        "task": "wine-mlp",
    }
    response = httpx.get(f"{server.url}{API_PREFIX}/calibration", params=query, timeout=30)
    response.raise_for_status()
    return Calibration.model_validate_json(response.content)


def test_an_unchunked_evaluation_is_predicted_and_the_wide_configuration_runs_as_planned(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    warm_up = wine_study(studies, [8, 16, 32], batch_size=8, n_trials=3)
    first = start_worker(fleet_server.url, SMALL, "--tasks", str(MY_TASK))
    small_runs = studies.wait_until(warm_up, finished(3), timeout=240)
    assert first.finish() == 0
    for trial in small_runs:
        assert trial.state == "COMPLETE" and trial.outcome == "as_asked", trial
        # The raw prediction is the measured run, evaluation included, but for the index
        # tensor the task's batch iterator keeps between steps (8 int64s, one 512 B block).
        assert trial.measured_peak_bytes is not None and trial.predicted_peak_bytes is not None
        assert 0 <= trial.measured_peak_bytes - trial.predicted_peak_bytes <= 512, trial
        # 89 held-out rows at once outweigh a training step of 8: the plan says so.
        assert trial.plan is not None and "set by the evaluation" in trial.plan.reason, trial
    # One worker alone does not move the fleet's correction (vramtune.service.fleet.calibration).
    calibration = served_calibration(fleet_server)
    assert (calibration.scale, calibration.n_observations) == (1.0, 0), calibration

    wide = wine_study(studies, [WIDE["width"]], WIDE["batch_size"], n_trials=1)
    second = start_worker(fleet_server.url, SMALL, "--tasks", str(MY_TASK))
    [trial] = studies.wait_until(wide, finished(1), timeout=240)
    assert second.finish() == 0
    assert trial.state == "COMPLETE", trial
    assert trial.outcome == "as_asked", trial
    assert trial.measured_peak_bytes is not None and trial.predicted_peak_bytes is not None
    assert 32 * 2**20 <= trial.measured_peak_bytes <= parse_size(SMALL)
    assert abs(trial.measured_peak_bytes - trial.predicted_peak_bytes) <= 4096  # the index tensor
    # Two workers' four runs: fitted, and the small runs' evaluation is no scale.
    calibration = served_calibration(fleet_server)
    assert calibration.n_observations >= 4
    assert abs(calibration.scale - 1.0) <= 0.02, calibration
