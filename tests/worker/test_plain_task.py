"""The smaller plain-PyTorch contract: four methods and two declarations make a Task whose
prediction equals the worker's measured run, evaluation included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from task_contract import check_task, run_trial, simulated_card

from vramtune.service.wire import Plan
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.tasks.check_file import check_file
from vramtune.worker.tasks.registry import discover
from vramtune.worker.trial.task import Task

EXAMPLE = Path(__file__).parents[2] / "examples" / "plain_task.py"


def example_task() -> Task:
    runner = discover([str(EXAMPLE)], entry_points=False).runners["plain-digits"]
    assert isinstance(runner, TorchTaskRunner)
    return runner.task


def test_the_example_keeps_the_whole_task_contract() -> None:
    task = example_task()
    assert isinstance(task, Task)
    check_task(task, {"width": 8, "batch_size": 6})


@pytest.mark.parametrize(
    ("config", "plan"),
    [
        ({"width": 16, "batch_size": 8}, Plan()),
        ({"width": 256, "batch_size": 64}, Plan(micro_batch=16, accumulation=4)),
    ],
    ids=["as asked", "micro-batches"],
)
def test_the_prediction_equals_the_measured_run_with_its_default_evaluation(
    config: dict[str, int], plan: Plan
) -> None:
    runner = TorchTaskRunner(example_task())
    predicted = runner.predict(config, plan, simulated_card())
    measured = run_trial(runner.task, config, steps=3, eval_every=1, plan=plan).measured
    assert measured.peak_allocated_bytes == predicted.peak_allocated_bytes


def test_the_default_evaluation_is_the_held_out_loss_in_chunks() -> None:
    task = example_task()
    model = task.build_model({"width": 8})
    first = task.evaluate(model, {"width": 8, "batch_size": 4}, torch.device("cpu"))
    again = task.evaluate(model, {"width": 8, "batch_size": 4}, torch.device("cpu"))
    assert first == again and 1.5 < first < 3.5  # an untrained 10-way classifier: about ln 10


def test_a_missing_method_is_named_by_the_check(tmp_path: Path) -> None:
    source = EXAMPLE.read_text()
    cut = source.index("    def loss(")
    path = tmp_path / "no_loss.py"
    path.write_text(source[:cut].rstrip() + "\n")
    report, code = check_file(
        str(path), study=None, config='{"width": 8, "batch_size": 6}', device="cpu"
    )
    findings, _rungs = report.rsplit("\n", 1)
    assert code == 1
    assert findings.endswith("raised NotImplementedError: DigitsTask: write loss(model, batch)")
