"""The adafactor rung (issue 32): `torch.optim.Adafactor` at the task optimizer's learning rate in
place of the task's optimizer. It changes the numerics, so a plan takes it only when the study
lists it and nothing that keeps the numerics fits; its prediction equals a real CPU run's peak.

Cost: ~1 min on 2 cores (a 2-block char transformer, two real CPU steps per exactness case).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_predictor import measured_cpu_peak

from vramtune.common.memory import peak_of
from vramtune.common.plans import plan_in_words, ran_as, rungs_of, stored_plan, told_outcome
from vramtune.service.wire import CardInfo, MemoryPolicy, Plan
from vramtune.worker.plan.policy import HandBack, RunAsPlanned, choose_plan
from vramtune.worker.predictor import clear_cache, predict
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.tasks.charlm import CharTransformerTask
from vramtune.worker.trial.runner import CardSpec
from vramtune.worker.trial.steps import (
    batch_feeder,
    build_for_plan,
    build_optimizer_for_plan,
    train_step,
)

# One sequence of 8: no micro-batches to take, and the optimizer's state sets the peak.
TINY: dict[str, Any] = {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 8, "batch_size": 1}
CPU = torch.device("cpu")
CPU_CARD = CardSpec(info=CardInfo(model="cpu", total_bytes=2**40, free_bytes=2**40))
ADAFACTOR = Plan(optimizer="adafactor")
WORDS = "Adafactor optimizer (changes numerics)"


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    clear_cache()
    yield
    clear_cache()


@pytest.mark.parametrize(
    ("config", "plan"),
    [
        (TINY, ADAFACTOR),
        ({**TINY, "batch_size": 2}, Plan(micro_batch=1, accumulation=2, optimizer="adafactor")),
        (TINY, Plan(bf16=True, checkpointing=True, optimizer="adafactor")),
    ],
    ids=["alone", "micro-batches", "bf16-checkpointing"],
)
def test_a_plan_with_adafactor_is_predicted_to_the_byte(config: dict[str, Any], plan: Plan) -> None:
    task = CharTransformerTask()
    prediction = predict(task, config, plan)
    assert prediction.method == "trace", prediction.reason
    assert prediction.peak_allocated_bytes == measured_cpu_peak(task, config, plan)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        value.nbytes
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def _optimizer_after_a_step(plan: Plan) -> torch.optim.Optimizer:
    """The optimizer the trainer builds for `plan`, after one real step."""
    task = CharTransformerTask()
    torch.manual_seed(0)
    model = build_for_plan(task, TINY, plan, CPU)
    optimizer = build_optimizer_for_plan(task, model, TINY, plan)
    next_batch = batch_feeder(task.batches(TINY, 1, CPU, seed=0))
    train_step(task, model, optimizer, next_batch, 1, plan, CPU)
    return optimizer


def test_adafactor_keeps_less_state_than_adamw_at_the_task_learning_rate() -> None:
    adamw, adafactor = _optimizer_after_a_step(Plan()), _optimizer_after_a_step(ADAFACTOR)
    assert isinstance(adamw, torch.optim.AdamW)
    assert isinstance(adafactor, torch.optim.Adafactor)
    assert adafactor.param_groups[0]["lr"] == adamw.param_groups[0]["lr"]
    assert 0 < _state_bytes(adafactor) < _state_bytes(adamw) / 4
    task = CharTransformerTask()
    predicted = [
        predict(task, TINY, plan).breakdown["optimizer_state"] for plan in (Plan(), ADAFACTOR)
    ]
    assert predicted[1] < predicted[0]


def test_the_policy_takes_adafactor_only_when_listed_and_nothing_precise_fits() -> None:
    task = CharTransformerTask()
    runner = TorchTaskRunner(task)
    as_asked, swapped = (peak_of(predict(task, TINY, plan)) for plan in (Plan(), ADAFACTOR))
    free = (swapped + as_asked) // 2
    precise: list[Any] = ["micro_batch", "checkpointing", "bf16"]
    unlisted = MemoryPolicy(resizes=precise, margin=0.0)
    assert isinstance(choose_plan(runner, TINY, unlisted, CPU_CARD, free), HandBack)

    listed = MemoryPolicy(resizes=[*precise, "adafactor"], margin=0.0)
    decision = choose_plan(runner, TINY, listed, CPU_CARD, free)
    assert isinstance(decision, RunAsPlanned), decision
    assert rungs_of(decision.plan) == ["adafactor"]  # bf16 alone did not fit; both not needed
    assert "rungs: adafactor" in decision.plan.reason
    assert plan_in_words(decision.plan) == WORDS
    real = measured_cpu_peak(task, TINY, decision.plan)
    assert real == decision.prediction.peak_allocated_bytes <= free
    # Room for the task's own optimizer: it runs as asked, the rung listed or not.
    roomy = choose_plan(runner, TINY, listed, CPU_CARD, as_asked)
    assert isinstance(roomy, RunAsPlanned) and roomy.plan.optimizer is None
    # A runner that builds its own optimizer is never offered the rung.
    own_loop = TorchTaskRunner(task)
    own_loop.can_swap_optimizer = False  # as the Trainer's and Lightning's runners say
    own = choose_plan(own_loop, TINY, listed, CPU_CARD, free)
    assert isinstance(own, HandBack)


def test_the_trial_record_shows_adafactor() -> None:
    ran = Plan(micro_batch=2, accumulation=4, optimizer="adafactor", reason="fits")
    stored = ran.model_dump(mode="json")  # what the server keeps as the trial's plan
    assert stored["optimizer"] == "adafactor"
    shown = stored_plan(stored)
    assert rungs_of(shown) == ["micro_batch", "adafactor"]
    assert plan_in_words(shown) == f"micro-batch 2 × 4, {WORDS}"
    assert ran_as(shown, routed=False) == "resized"
    assert ran_as(stored_plan({"optimizer": "adafactor"}), routed=False) == "resized"
    assert told_outcome("pruned", {"optimizer": "adafactor"}, handed_back=False) == (
        "resized, pruned"
    )
