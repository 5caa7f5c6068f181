"""The built-in tasks and the README's user task keep the Task contract."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from task_contract import check_task

from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.tasks.charlm import CharTransformerTask
from vramtune.worker.tasks.digits import DigitsCNNTask, DigitsMLPTask
from vramtune.worker.tasks.registry import discover
from vramtune.worker.trial.task import Task

EXAMPLE_TASK = Path(__file__).parents[2] / "examples" / "my_task.py"

CASES: list[tuple[Task, dict[str, Any], list[dict[str, Any]]]] = [
    (
        DigitsMLPTask(),
        {"width": 16, "depth": 2, "resolution": 12, "batch_size": 6},
        [{"width": 0}, {"depth": "deep"}, {"resolution": 4}, {"widht": 16}],
    ),
    (
        DigitsCNNTask(),
        {"width": 4, "depth": 2, "resolution": 12, "batch_size": 6},
        [{"width": -1}, {"lr": 0}],
    ),
    (
        CharTransformerTask(),
        {"n_layers": 2, "d_model": 16, "n_heads": 2, "seq_len": 8, "batch_size": 6},
        [{"d_model": 30, "n_heads": 4}, {"dropout": 1.0}, {"seq_len": 1}],
    ),
]


@pytest.mark.parametrize(("task", "config", "bad"), CASES, ids=[task.name for task, _, _ in CASES])
def test_builtin_task_keeps_the_contract(
    task: Task, config: dict[str, Any], bad: list[dict[str, Any]]
) -> None:
    check_task(task, config, bad_configs=bad)


def test_the_readme_user_task_keeps_the_contract() -> None:
    runner = discover([str(EXAMPLE_TASK)], entry_points=False).runners["wine-mlp"]
    assert isinstance(runner, TorchTaskRunner)
    check_task(runner.task, {"width": 8, "batch_size": 5})


def test_the_readme_user_task_is_under_40_lines() -> None:
    assert len(EXAMPLE_TASK.read_text().splitlines()) < 40


def test_a_bad_config_names_the_task_and_the_problem() -> None:
    with pytest.raises(
        Exception, match=r"char-transformer: d_model \(30\) must be divisible by n_heads \(4\)"
    ):
        CharTransformerTask().build_model({"d_model": 30, "n_heads": 4})
    with pytest.raises(
        Exception, match=r"digits-cnn: width: Input should be greater than or equal to 1"
    ):
        DigitsCNNTask().build_model({"width": 0})
