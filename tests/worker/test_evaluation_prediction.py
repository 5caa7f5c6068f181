"""Issue 29 item 4: a task's evaluation is traced like its training step, measured apart from
it, and bounded with a reason where it cannot be traced."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from task_contract import run_trial, simulated_card
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from vramtune.service.wire import MemoryPolicy, Plan
from vramtune.worker.plan.policy import RunAsPlanned, choose_plan
from vramtune.worker.predictor import clear_cache, predict
from vramtune.worker.predictor.evaluation import UNTRACED_BOUND
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.tasks import digits as digits_module
from vramtune.worker.tasks.digits import DigitsMLPTask
from vramtune.worker.trial.task import Config

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from my_task import WineTask


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    clear_cache()
    yield
    clear_cache()


@pytest.mark.parametrize(
    ("config", "evaluation_sets_the_peak"),
    [({"width": 32, "batch_size": 8}, True), ({"width": 4096, "batch_size": 512}, False)],
    ids=["evaluation-peak", "training-peak"],
)
def test_an_unchunked_evaluation_is_predicted_apart_from_the_training_step(
    config: Config, evaluation_sets_the_peak: bool
) -> None:
    """examples/my_task.py evaluates all 89 held-out rows in one forward pass."""
    predicted = predict(WineTask(), config, Plan(), simulated_card())
    measured = run_trial(WineTask(), config, steps=4, eval_every=2).measured
    assert predicted.method == "trace" and predicted.reason == ""
    # Both parts differ by the index tensor the task's batch iterator keeps alive between
    # steps (batch_size int64s, in 512 B blocks), which the trace's example batches lack.
    index = -(-8 * config["batch_size"] // 512) * 512
    assert predicted.training_peak_bytes is not None and predicted.evaluation_peak_bytes
    assert measured.training_peak_bytes == predicted.training_peak_bytes + index
    assert measured.evaluation_peak_bytes == predicted.evaluation_peak_bytes + index
    larger = max(predicted.training_peak_bytes, predicted.evaluation_peak_bytes)
    assert predicted.peak_allocated_bytes == larger
    assert (predicted.evaluation_peak_bytes > predicted.training_peak_bytes) == (
        evaluation_sets_the_peak
    )


def test_the_plan_fits_the_evaluation_and_says_it_set_the_peak() -> None:
    runner, config, card = TorchTaskRunner(WineTask()), {"width": 32, "batch_size": 8}, 64 * 2**20
    decision = choose_plan(runner, config, MemoryPolicy(), simulated_card(card), card)
    assert isinstance(decision, RunAsPlanned)
    assert decision.prediction.peak_allocated_bytes == decision.prediction.evaluation_peak_bytes
    assert "set by the evaluation" in decision.plan.reason


class MaskedEvaluationTask(WineTask):
    """Evaluates through a boolean mask of the model's output: a data-dependent shape."""

    def evaluate(self, model: nn.Module, config: Config, device: torch.device) -> float:
        logits = model(self.x[1::2].to(device))
        return float(logits[logits.argmax(1) == 0].numel())


def test_an_evaluation_that_cannot_be_traced_is_bounded_and_says_why() -> None:
    config = {"width": 32, "batch_size": 8}
    predicted = predict(MaskedEvaluationTask(), config, Plan(), simulated_card())
    assert predicted.method == "trace"
    assert predicted.evaluation_peak_bytes is None
    assert predicted.reason.startswith(UNTRACED_BOUND.split("(")[0])
    assert "data-dependent output shape" in predicted.reason
    assert predicted.training_peak_bytes is not None
    assert predicted.peak_allocated_bytes >= predicted.training_peak_bytes


def test_a_data_set_first_loaded_inside_the_trace_stays_real() -> None:
    """The digits task caches its data set: loaded first under the trace's fake tensors, the
    cache must hold real tensors for the runs that follow."""
    digits_module.digits.cache_clear()
    config = {"width": 16, "depth": 1, "resolution": 8, "batch_size": 8}
    predicted = predict(DigitsMLPTask(), config, Plan(), simulated_card())
    assert predicted.evaluation_peak_bytes is not None
    assert not any(isinstance(t, FakeTensor) for t in digits_module.digits())
    result = run_trial(DigitsMLPTask(), config, steps=2, eval_every=1)
    assert result.values[0] >= 0
    # Loaded by the trace's first, uncounted evaluation: in neither peak, as in the run.
    assert result.measured.evaluation_peak_bytes == predicted.evaluation_peak_bytes
    assert result.measured.peak_allocated_bytes == predicted.peak_allocated_bytes
