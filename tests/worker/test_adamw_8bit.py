"""The adamw_8bit rung (issue 32): torchao's AdamW8bit (AdamW with both moments stored blockwise
in 8 bits) in place of the task's optimizer. It changes the numerics, so a plan takes it only
when the study lists it and nothing that keeps the numerics fits; it is tried before Adafactor
(it keeps AdamW's update). Its state is a tensor subclass (`OptimState8bit`): the trace counts
its codes and scales, and its prediction equals a real CPU run's peak.

Cost: ~2 min at load 6, ~5 min at load 10 on 2 cores (a 2-block char transformer, two real CPU
steps per exactness case; one more GPU case skips itself without a device).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_adafactor import CPU, CPU_CARD, TINY, _optimizer_after_a_step
from test_predictor import measured_cpu_peak

from vramtune.common.memory import peak_of
from vramtune.common.plans import plan_in_words, ran_as, rungs_of, stored_plan
from vramtune.service.wire import MemoryPolicy, Plan
from vramtune.worker.device.memory import MemoryTracker
from vramtune.worker.plan import policy
from vramtune.worker.plan.policy import HandBack, RunAsPlanned, choose_plan
from vramtune.worker.predictor import clear_cache, predict
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.tasks.charlm import CharTransformerTask
from vramtune.worker.trial import optimizers, rungs
from vramtune.worker.trial.steps import build_for_plan, build_optimizer_for_plan
from vramtune.worker.trial.task import TaskConfigError

torchao_optim = pytest.importorskip("torchao.optim")  # the optim8bit extra (in dev)

ADAMW_8BIT = Plan(optimizer="adamw_8bit")
WORDS = "8-bit AdamW optimizer (changes numerics)"


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    clear_cache()
    yield
    clear_cache()


@pytest.mark.parametrize(
    ("config", "plan"),
    [
        (TINY, ADAMW_8BIT),
        ({**TINY, "batch_size": 2}, Plan(micro_batch=1, accumulation=2, optimizer="adamw_8bit")),
        (TINY, Plan(bf16=True, checkpointing=True, optimizer="adamw_8bit")),
    ],
    ids=["alone", "micro-batches", "bf16-checkpointing"],
)
def test_a_plan_with_8bit_adamw_is_predicted_to_the_byte(
    config: dict[str, Any], plan: Plan
) -> None:
    task = CharTransformerTask()
    prediction = predict(task, config, plan)
    assert prediction.method == "trace", prediction.reason
    assert prediction.peak_allocated_bytes == measured_cpu_peak(task, config, plan)


def test_8bit_adamw_keeps_a_third_of_adamws_state_at_the_task_hyperparameters() -> None:
    adamw = _optimizer_after_a_step(Plan())
    with MemoryTracker(device_type="cpu"):  # as a CPU run steps: eagerly, torch.compile unused
        eight_bit = _optimizer_after_a_step(ADAMW_8BIT)
    assert isinstance(eight_bit, torchao_optim.AdamW8bit)
    for ours, theirs in zip(eight_bit.param_groups, adamw.param_groups, strict=True):
        assert ours["lr"] == torch.tensor(theirs["lr"])  # torchao keeps it as an fp32 tensor
        for key in ("betas", "eps", "weight_decay"):
            assert ours[key] == theirs[key]
    # Every 64 × 64 weight's moments are 8-bit codes; a vector's stay fp32 (under 4,096 values).
    square = next(p for p in eight_bit.state if p.shape == (64, 64))
    assert type(eight_bit.state[square]["exp_avg"]).__name__ == "OptimState8bit"
    assert eight_bit.state[square]["exp_avg"].codes.dtype == torch.uint8
    task = CharTransformerTask()
    predicted = [
        predict(task, TINY, plan).breakdown["optimizer_state"] for plan in (Plan(), ADAMW_8BIT)
    ]
    # 8 -> 2 bytes a value where quantized; small tensors, scales and the code maps add the rest.
    assert predicted[1] < predicted[0] / 3


def test_the_policy_takes_8bit_adamw_when_listed_before_adafactor() -> None:
    task = CharTransformerTask()
    runner = TorchTaskRunner(task)
    as_asked, eight_bit, adafactor = (
        peak_of(predict(task, TINY, plan))
        for plan in (Plan(), ADAMW_8BIT, Plan(optimizer="adafactor"))
    )
    assert adafactor < eight_bit < as_asked
    free = (eight_bit + as_asked) // 2
    precise: list[Any] = ["micro_batch", "checkpointing", "bf16"]
    unlisted = MemoryPolicy(resizes=[*precise, "adafactor"], margin=0.0)
    only_adafactor = choose_plan(runner, TINY, unlisted, CPU_CARD, free)
    assert isinstance(only_adafactor, RunAsPlanned) and rungs_of(only_adafactor.plan) == [
        "adafactor"
    ]

    listed = MemoryPolicy(resizes=[*precise, "adafactor", "adamw_8bit"], margin=0.0)
    decision = choose_plan(runner, TINY, listed, CPU_CARD, free)
    assert isinstance(decision, RunAsPlanned), decision
    assert rungs_of(decision.plan) == ["adamw_8bit"]  # before Adafactor, which also fits
    assert "rungs: adamw_8bit" in decision.plan.reason
    assert plan_in_words(decision.plan) == WORDS
    real = measured_cpu_peak(task, TINY, decision.plan)
    assert real == decision.prediction.peak_allocated_bytes <= free
    # Below 8-bit AdamW's footprint Adafactor's smaller state is the one that fits.
    tight = choose_plan(runner, TINY, listed, CPU_CARD, (adafactor + eight_bit) // 2)
    assert isinstance(tight, RunAsPlanned) and tight.plan.optimizer == "adafactor"
    # A runner that builds its own optimizer is never offered the rung.
    own_loop = TorchTaskRunner(task)
    own_loop.can_swap_optimizer = False  # as the Trainer's and Lightning's runners say
    own = choose_plan(
        own_loop, TINY, MemoryPolicy(resizes=["adamw_8bit"], margin=0.0), CPU_CARD, free
    )
    assert isinstance(own, HandBack)


def test_without_torchao_the_rung_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    task = CharTransformerTask()
    free = peak_of(predict(task, TINY, ADAMW_8BIT))  # 8-bit AdamW would fit
    monkeypatch.setattr(policy, "adamw_8bit_available", lambda: False)
    monkeypatch.setattr(rungs, "adamw_8bit_available", lambda: False)  # the supported rungs
    monkeypatch.setattr(optimizers, "adamw_8bit_available", lambda: False)
    listed = MemoryPolicy(resizes=["adamw_8bit"], margin=0.0)
    decision = choose_plan(TorchTaskRunner(task), TINY, listed, CPU_CARD, free)
    assert isinstance(decision, HandBack)
    assert "the adamw_8bit rung is listed but torchao is not installed" in decision.reason
    assert "vramtune[optim8bit]" in decision.reason
    model = build_for_plan(task, TINY, ADAMW_8BIT, CPU)
    with pytest.raises(TaskConfigError, match="adamw_8bit rung needs torchao"):
        build_optimizer_for_plan(task, model, TINY, ADAMW_8BIT)


def test_the_trial_record_shows_8bit_adamw() -> None:
    ran = Plan(micro_batch=2, accumulation=4, bf16=True, optimizer="adamw_8bit", reason="fits")
    stored = ran.model_dump(mode="json")  # what the server keeps as the trial's plan
    assert stored["optimizer"] == "adamw_8bit"
    shown = stored_plan(stored)
    assert rungs_of(shown) == ["micro_batch", "bf16", "adamw_8bit"]
    assert plan_in_words(shown) == f"micro-batch 2 × 4, bf16, {WORDS}"
    assert ran_as(shown, routed=False) == "resized"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_card_the_compiled_update_needs_no_more_than_predicted() -> None:
    """On CUDA, outside any dispatch mode, torchao compiles the update; the trace counts the
    eager one's temporaries (one parameter's at a time), so it may count over, never under.
    The bound (25 %) is a first guess for bench/gpu_check.sh, not yet measured on a card."""
    from vramtune.service.wire import CardInfo
    from vramtune.worker.predictor import measure_card_constants
    from vramtune.worker.trial.runner import CardSpec
    from vramtune.worker.trial.steps import batch_feeder, train_step

    device = torch.device("cuda:0")
    card = CardSpec(
        info=CardInfo(model=torch.cuda.get_device_name(0), total_bytes=1, free_bytes=1),
        constants=measure_card_constants(device).model_dump(),
        device="cuda:0",
    )
    task = CharTransformerTask()
    config = {"n_layers": 4, "d_model": 256, "n_heads": 8, "seq_len": 128, "batch_size": 16}
    prediction = predict(task, config, ADAMW_8BIT, card)
    assert prediction.method == "trace", prediction.reason
    torch.cuda.reset_peak_memory_stats(device)
    model = build_for_plan(task, config, ADAMW_8BIT, device)
    optimizer = build_optimizer_for_plan(task, model, config, ADAMW_8BIT)
    next_batch = batch_feeder(task.batches(config, 16, device, seed=0))
    for _ in range(2):
        train_step(task, model, optimizer, next_batch, 16, ADAMW_8BIT, device)
    measured = torch.cuda.max_memory_allocated(device)
    print(
        f"adamw_8bit on {card.info.model}: predicted {prediction.peak_allocated_bytes:,}, "
        f"measured {measured:,}"
    )
    assert measured * 0.995 <= prediction.peak_allocated_bytes <= measured * 1.25


def test_the_trial_story_says_the_optimizer_was_swapped() -> None:
    from vramtune.service.dashboard.story import plan_words

    stored = Plan(micro_batch=4, accumulation=2, optimizer="adamw_8bit").model_dump(mode="json")
    assert plan_words(stored) == f"micro-batch 4 × 2, {WORDS}"
    assert plan_words({"optimizer": "adafactor"}) == "Adafactor optimizer (changes numerics)"


def test_a_cuda_card_traces_the_8bit_state_on_this_cpu_build() -> None:
    """A GPU worker's trace (CUDA's rules emulated on fake cpu here) counts the same state."""
    from vramtune.service.wire import CardInfo
    from vramtune.worker.trial.runner import CardSpec

    info = CardInfo(model="NVIDIA H100", total_bytes=80 * 2**30, free_bytes=80 * 2**30)
    card = CardSpec(info=info, device="cuda:0")
    task = CharTransformerTask()
    adamw, eight_bit = (predict(task, TINY, plan, card) for plan in (Plan(), ADAMW_8BIT))
    assert eight_bit.method == "trace", eight_bit.reason
    on_cpu = predict(task, TINY, ADAMW_8BIT).breakdown["optimizer_state"]
    assert eight_bit.breakdown["optimizer_state"] == on_cpu < adamw.breakdown["optimizer_state"] / 3


def test_the_workers_own_loop_runs_the_rung_and_measures_the_predicted_peaks() -> None:
    """The trainer a worker runs on a simulated CPU card: the same peaks, training and
    evaluation, as the prediction, to the byte."""
    from task_contract import run_trial

    task = CharTransformerTask()
    result = run_trial(task, TINY, steps=3, plan=ADAMW_8BIT)
    prediction = predict(task, TINY, ADAMW_8BIT)
    assert result.values and all(map(math.isfinite, result.values))
    assert result.measured.training_peak_bytes == prediction.training_peak_bytes
    assert result.measured.evaluation_peak_bytes == prediction.evaluation_peak_bytes
