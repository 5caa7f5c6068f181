"""The Lightning integration: a user's LightningModule + LightningDataModule, as they are.

The prediction (two traced steps through the module's own training_step and
configure_optimizers) is compared with a real `lightning.Trainer.fit` measured by the worker's
CPU meter; bad modules are refused naming the member; a worker without lightning does not
advertise the task.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L

from vramtune.service.wire import Plan, TrainBudget
from vramtune.worker.device.gpu import parse_size, simulated_card
from vramtune.worker.integrations.lightning import LightningTask, divisors
from vramtune.worker.tasks.registry import discover
from vramtune.worker.trial.runner import CardSpec, OutOfMemory, Stopped, plan_for_micro_batch
from vramtune.worker.trial.task import TaskConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning"
sys.path.insert(0, str(EXAMPLE))
from digits_lightning import DigitsClassifier, DigitsDataModule  # noqa: E402

CARD = CardSpec(info=simulated_card(parse_size("1GiB")))
# Validation every 2 steps, as a worker validates every eval_every steps: step 4 runs beside step
# 3's gradients and what validation left (Lightning frees the gradients before validating).
FEW_STEPS = TrainBudget(max_steps=4, eval_every=2)


class Reporter:
    """Records reports; prunes at the first one when asked to."""

    def __init__(self, prune: bool = False) -> None:
        self.prune = prune
        self.reports: list[tuple[int, float]] = []

    def report(self, step: int, value: float) -> bool:
        self.reports.append((step, value))
        return self.prune

    def stop_reason(self) -> str | None:
        return None


def digits_task(**overrides: Any) -> LightningTask:
    options: dict[str, Any] = {
        "name": "digits-lightning",
        "module": lambda c: DigitsClassifier(c["width"], c.get("depth", 2), c.get("lr", 1e-3)),
        "datamodule": lambda c: DigitsDataModule(c["batch_size"]),
        "monitor": "val_acc",
        "shape_params": frozenset({"width", "depth"}),
        "checkpoint_modules": lambda module: list(module.net)[1:-1],
    }
    return LightningTask(**(options | overrides))


@pytest.mark.parametrize(
    ("width", "batch", "micro", "checkpointing", "bf16"),
    [
        (256, 64, 64, False, False),  # as asked
        (256, 64, 16, False, False),  # accumulate_grad_batches=4
        (128, 96, 8, False, False),  # 12: the trace runs micro-batches 1, 2 and 12
        (512, 96, 32, True, False),  # checkpointing
        (256, 64, 32, False, True),  # bf16-mixed
    ],
)
def test_the_prediction_is_the_real_trainer_runs_peak_to_the_byte(
    width: int, batch: int, micro: int, checkpointing: bool, bf16: bool
) -> None:
    task = digits_task()
    config = {"width": width, "depth": 3, "batch_size": batch}
    plan = plan_for_micro_batch(batch, micro, checkpointing=checkpointing, bf16=bf16)
    predicted = task.predict(config, plan, CARD)
    assert predicted.method == "trace"
    result = task.run(config, plan, FEW_STEPS, CARD, Reporter())
    assert result.steps == 4
    assert predicted.peak_allocated_bytes == result.measured.peak_allocated_bytes
    assert 0.0 <= result.values[0] <= 1.0


@pytest.mark.parametrize(
    ("width", "batch", "micro", "bf16"),
    [(256, 64, 64, False), (256, 64, 16, False), (512, 96, 32, True)],
    ids=["as-asked", "accumulating", "bf16"],
)
def test_the_validation_is_predicted_and_measured_apart(
    width: int, batch: int, micro: int, bf16: bool
) -> None:
    # The module's validation_step is traced after the two steps as fit runs it (gradients
    # released, eval mode, no autograd) and measured between on_validation_start and _end.
    task = digits_task()
    config = {"width": width, "depth": 3, "batch_size": batch}
    plan = plan_for_micro_batch(batch, micro, bf16=bf16)
    predicted = task.predict(config, plan, CARD)
    assert predicted.reason == ""
    result = task.run(config, plan, FEW_STEPS, CARD, Reporter())
    measured = result.measured
    assert measured.evaluation_peak_bytes is not None
    assert predicted.evaluation_peak_bytes is not None
    # Where an epoch is not a whole number of accumulation windows (64 / 16 here, not 96 / 32),
    # a later validation can fall inside one, beside its gradients (Lightning releases them
    # only at a step's boundary), so the trace keeps them. These four steps validate at
    # boundaries only: over by exactly the gradients then, the safe side.
    aligned = task.sample_batch(config, micro).validates_between_steps(batch // micro)
    over = 0 if aligned else predicted.breakdown["gradients"]
    assert aligned == (micro != 16)
    assert predicted.evaluation_peak_bytes - measured.evaluation_peak_bytes == over
    assert predicted.training_peak_bytes == measured.training_peak_bytes


def test_without_validation_during_training_the_prediction_is_over_by_its_leftovers() -> None:
    task = digits_task()
    config = {"width": 128, "depth": 2, "batch_size": 64}
    plan = plan_for_micro_batch(64, 16)
    predicted = task.predict(config, plan, CARD)
    # No validation before the last step: the three blocks val_acc leaves are never made.
    budget = TrainBudget(max_steps=3, eval_every=1000)
    result = task.run(config, plan, budget, CARD, Reporter())
    assert predicted.peak_allocated_bytes - result.measured.peak_allocated_bytes == 3 * 512


def test_resizing_keeps_the_effective_batch_through_whole_loader_batches() -> None:
    task = digits_task()
    config = {"width": 64, "batch_size": 96}
    # 96 = 3 x 32: a plan asking for 40 runs 32 (Lightning accumulates whole batches).
    whole = task.predict(config, plan_for_micro_batch(96, 96), CARD)
    budget = whole.peak_allocated_bytes - 1
    found = task.largest_micro_batch(config, Plan(), budget, CARD)
    assert found is not None
    micro, prediction = found
    assert micro in divisors(96) and micro < 96
    assert prediction.peak_allocated_bytes <= budget


def test_the_simulated_card_runs_out_of_memory_as_predicted() -> None:
    task = digits_task()
    config = {"width": 512, "batch_size": 64}
    plan = plan_for_micro_batch(64, 64)
    peak = task.predict(config, plan, CARD).peak_allocated_bytes
    small = CardSpec(info=simulated_card(peak - 4096))
    with pytest.raises(OutOfMemory):
        task.run(config, plan, FEW_STEPS, small, Reporter())


def test_validation_is_reported_and_a_pruned_run_stops() -> None:
    task = digits_task()
    config = {"width": 32, "batch_size": 32}
    reporter = Reporter(prune=True)
    with pytest.raises(Stopped) as stopped:
        task.run(config, Plan(), TrainBudget(max_steps=10, eval_every=2), CARD, reporter)
    assert stopped.value.reason == "pruned"
    assert reporter.reports and reporter.reports[0][0] == 2


def test_the_final_value_is_the_monitored_metric_at_the_last_step() -> None:
    reporter = Reporter()
    result = digits_task().run(
        {"width": 32, "batch_size": 32},
        Plan(),
        TrainBudget(max_steps=4, eval_every=2),
        CARD,
        reporter,
    )
    assert [step for step, _ in reporter.reports] == [2, 4]
    assert result.values == [reporter.reports[-1][1]]


class NoOptimizers(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(64, 10)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1])


class NoTrainingStep(L.LightningModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ReturnsNone(NoOptimizers):
    def configure_optimizers(self) -> None:
        return None


class Manual(NoOptimizers):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("module", "named"),
    [
        (NoOptimizers, "NoOptimizers does not define configure_optimizers"),
        (NoTrainingStep, "NoTrainingStep does not define training_step"),
        (ReturnsNone, "ReturnsNone.configure_optimizers returned None"),
        (Manual, "Manual.automatic_optimization is False"),
        (torch.nn.Linear(64, 10).__class__, "not a LightningModule"),
    ],
)
def test_a_module_lacking_what_lightning_needs_is_refused_naming_the_member(
    module: type, named: str
) -> None:
    def build(config: Any) -> Any:
        return module(64, 10) if module is torch.nn.Linear else module()

    task = digits_task(module=build)
    config = {"width": 8, "batch_size": 8}
    with pytest.raises(TaskConfigError, match=named):
        task.predict(config, Plan(), CARD)
    with pytest.raises(TaskConfigError, match=named):
        task.run(config, Plan(), FEW_STEPS, CARD, Reporter())


def test_bad_configuration_and_data_module_name_the_field() -> None:
    with pytest.raises(TaskConfigError, match="batch_size: missing"):
        digits_task().predict({"width": 8}, Plan(), CARD)
    with pytest.raises(TaskConfigError, match="datamodule returned dict"):
        digits_task(datamodule=lambda c: {}).predict({"width": 8, "batch_size": 8}, Plan(), CARD)
    with pytest.raises(TaskConfigError, match="monitor: validation logged no 'val_loss'"):
        digits_task(monitor="val_loss").run(
            {"width": 8, "batch_size": 8}, Plan(), FEW_STEPS, CARD, Reporter()
        )


def test_the_example_is_advertised_with_its_metric() -> None:
    found = discover([str(EXAMPLE / "tasks.py")], entry_points=False)
    assert not found.errors, found.errors
    runner = found.runners["digits-lightning"]
    assert isinstance(runner, LightningTask)
    assert runner.metric.name == "val_acc"


def test_a_worker_without_lightning_does_not_advertise_the_task() -> None:
    script = (
        "import sys, json; sys.modules['lightning'] = None\n"
        "from vramtune.worker.tasks.registry import discover\n"
        f"found = discover([{str(EXAMPLE / 'tasks.py')!r}], entry_points=False)\n"
        "try:\n"
        "    import vramtune.worker.integrations.lightning\n"
        "except ImportError as error:\n"
        "    found.errors['integration'] = str(error)\n"
        "print(json.dumps({'runners': sorted(found.runners), 'errors': found.errors}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "digits-lightning" not in found["runners"]
    assert str(EXAMPLE / "tasks.py") in found["errors"]  # listed as failed, not advertised
    assert "pip install 'vramtune[lightning]'" in found["errors"]["integration"]
