"""Users' own task files end to end: a real server (SQLite and PostgreSQL), a real worker that
loads the file with --tasks, the trials planned, run, measured and recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.e2e.conftest import Studies, WorkerFactory, finished
from vramtune.service.testing import ServerProcess

EXAMPLES = Path(__file__).parents[2] / "examples"
SPACE = {
    "width": {"type": "int", "low": 8, "high": 64},
    "batch_size": {"type": "int", "low": 8, "high": 32},
}
SHORT = {"max_steps": 20, "eval_every": 10}


def study_of(studies: Studies, task: str, metric: str, direction: str) -> str:
    """Three trials of a user's task: the space, the budget and the objective it declares."""
    body: dict[str, Any] = {"task": task, "task_config": {}, "n_trials": 3, "budget": SHORT}
    body |= {"directions": [direction], "metric_names": [metric]}
    return studies.create(SPACE, **body)


def test_users_task_files_run_on_a_fleet_worker_and_are_measured_as_predicted(
    fleet_server: ServerProcess, studies: Studies, start_worker: WorkerFactory
) -> None:
    plain = study_of(studies, "plain-digits", "loss", "minimize")
    wine = study_of(studies, "wine-mlp", "accuracy", "maximize")
    files = [str(EXAMPLES / name) for name in ("plain_task.py", "my_task.py")]
    worker = start_worker(fleet_server.url, "256MiB", "--tasks", files[0], "--tasks", files[1])
    trials = studies.wait_until(plain, finished(3), timeout=240)
    wine_trials = studies.wait_until(wine, finished(3), timeout=240)
    assert worker.finish() == 0
    for trial in trials:
        assert trial.state == "COMPLETE" and trial.outcome == "as_asked", trial
        assert trial.values is not None and 0 < trial.values[0] < 3  # a held-out loss
        # The default evaluation is chunked: the run's peak is the traced training step's, which
        # the served prediction (the trace with the card's calibration margin) covers. The raw
        # trace equals it to the byte: tests/worker/test_plain_task.py.
        assert trial.measured_peak_bytes is not None and trial.predicted_peak_bytes is not None
        assert trial.measured_peak_bytes <= trial.predicted_peak_bytes, trial
        assert trial.predicted_peak_bytes <= 1.1 * trial.measured_peak_bytes, trial
    assert [t.state for t in wine_trials] == ["COMPLETE"] * 3, wine_trials
    assert all(t.values is not None and 0 <= t.values[0] <= 1 for t in wine_trials)
