"""The plan ladder's newer rungs: selective checkpointing (k of L blocks) and chunked
cross-entropy, alone and combined, predicted exactly against real CPU runs and chosen by the fit
policy.

Cost: ~5 min at load 16 on 2 cores (tiny Llama, GPT-2 and char-transformer configs, two real
CPU steps per exactness case).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from test_predictor import measured_cpu_peak

from vramtune.common.memory import peak_of
from vramtune.common.plans import plan_key, rungs_of
from vramtune.service.wire import CardInfo, MemoryPolicy, Plan
from vramtune.worker.plan.policy import HandBack, RunAsPlanned, choose_plan
from vramtune.worker.predictor import clear_cache, predict
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.tasks.charlm import CharTransformerTask
from vramtune.worker.trial.runner import CardSpec
from vramtune.worker.trial.steps import build_for_plan
from vramtune.worker.trial.task import Task, TaskConfigError

pytest.importorskip("transformers", reason="pip install 'vramtune[hf]'")

LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 4,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "seq_len": 32,
    "batch_size": 4,
    "corpus_chars": 20_000,
    "eval_windows": 4,
}
BIG_VOCAB = {**LLAMA, "num_hidden_layers": 2, "vocab_size": 4096}
GPT2 = {**LLAMA, "model_type": "gpt2", "num_key_value_heads": None, "dropout": 0.1}
LORA = {**LLAMA, "finetune": {"method": "lora", "r": 8, "lora_alpha": 16}}
# One long sequence: no micro-batches to take, activations above the optimizer step's peak.
LONG = {**LLAMA, "batch_size": 1, "seq_len": 256}
LONG_BIG_VOCAB = {**LONG, "num_hidden_layers": 2, "vocab_size": 16384}
# Longer still, four blocks: the logits and the blocks' activations both above the optimizer's
# peak, so that checkpointing some blocks lowers the peak of the chunked loss further.
LONGER_BIG_VOCAB = {**LONG, "seq_len": 512, "vocab_size": 8192}
CHAR = {"n_layers": 4, "d_model": 32, "n_heads": 4, "seq_len": 32, "batch_size": 4}
CPU = torch.device("cpu")
CPU_CARD = CardSpec(info=CardInfo(model="cpu", total_bytes=2**40, free_bytes=2**40))


def _hf() -> Task:
    from vramtune.worker.tasks.hf import HFCausalLMTask

    return HFCausalLMTask()


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    clear_cache()
    yield
    clear_cache()


SELECTIVE = [Plan(checkpointing=True, checkpoint_blocks=k) for k in (1, 3)]


@pytest.mark.parametrize("plan", SELECTIVE, ids=["1-of-4", "3-of-4"])
@pytest.mark.parametrize(
    ("family", "config"),
    [("hf", LLAMA), ("hf", GPT2), ("hf", LORA), ("char", CHAR)],
    ids=["llama", "gpt2-dropout", "llama-lora", "char-transformer"],
)
def test_selective_checkpointing_is_predicted_to_the_byte(
    family: str, config: dict[str, Any], plan: Plan
) -> None:
    if config is LORA:
        pytest.importorskip("peft", reason="pip install 'vramtune[peft]'")
    task = _hf() if family == "hf" else CharTransformerTask()
    prediction = predict(task, config, plan)
    assert prediction.method == "trace", prediction.reason
    assert prediction.peak_allocated_bytes == measured_cpu_peak(task, config, plan)


@pytest.mark.parametrize("task", [_hf(), CharTransformerTask()], ids=["llama", "char"])
def test_each_checkpointed_block_lowers_the_peak(task: Task) -> None:
    config = LLAMA if task.name == "hf-causal-lm" else CHAR
    peaks = [peak_of(predict(task, config, Plan())) for _ in range(1)]
    peaks += [
        peak_of(predict(task, config, Plan(checkpointing=True, checkpoint_blocks=k)))
        for k in (1, 2, 3)
    ]
    peaks.append(peak_of(predict(task, config, Plan(checkpointing=True))))
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks), peaks


def test_selective_checkpointing_wraps_only_the_first_blocks() -> None:
    model = build_for_plan(_hf(), LLAMA, Plan(checkpointing=True, checkpoint_blocks=2), CPU)
    flags = [layer.gradient_checkpointing for layer in model.model.layers]  # type: ignore[union-attr]
    assert flags == [True, True, False, False]


def _loss_and_gradients(config: dict[str, Any], chunked: bool) -> tuple[float, list[Any]]:
    task = _hf()
    model = build_for_plan(task, config, Plan(chunked_loss=chunked), CPU)
    batch = next(iter(task.batches(config, 4, CPU, seed=0)))
    loss = task.loss(model, batch)
    loss.backward()
    return float(loss), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("config", [BIG_VOCAB, {**GPT2, "vocab_size": 4096}], ids=["llama", "gpt2"])
def test_chunked_cross_entropy_gives_the_same_loss_and_gradients(config: dict[str, Any]) -> None:
    whole_loss, whole_grads = _loss_and_gradients({**config, "dropout": 0.0}, chunked=False)
    chunked_loss, chunked_grads = _loss_and_gradients({**config, "dropout": 0.0}, chunked=True)
    assert chunked_loss == pytest.approx(whole_loss, rel=1e-6)
    assert len(whole_grads) == len(chunked_grads)
    # float32 sums in another order: within a few ulps of the gradient's scale (1.5e-7 on a
    # 5e-3 element was seen on one CPU; an error in the chunking would be of the gradient's size)
    for whole, chunked in zip(whole_grads, chunked_grads, strict=True):
        scale = float(whole.abs().max())
        torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize(
    "plan",
    [Plan(chunked_loss=True), Plan(chunked_loss=True, micro_batch=2, accumulation=2)],
    ids=["chunked", "chunked-micro2"],
)
def test_chunked_cross_entropy_is_predicted_to_the_byte_and_lowers_the_peak(plan: Plan) -> None:
    task = _hf()
    prediction = predict(task, BIG_VOCAB, plan)
    assert prediction.method == "trace", prediction.reason
    assert prediction.peak_allocated_bytes == measured_cpu_peak(task, BIG_VOCAB, plan)
    whole = plan.model_copy(update={"chunked_loss": False})
    assert peak_of(prediction) < peak_of(predict(task, BIG_VOCAB, whole))


def test_a_task_without_a_chunked_loss_refuses_the_rung() -> None:
    with pytest.raises(TaskConfigError, match="cannot compute its loss in chunks"):
        build_for_plan(CharTransformerTask(), CHAR, Plan(chunked_loss=True), CPU)


def _between(task: Task, config: dict[str, Any], low: Plan, high: Plan) -> int:
    """A budget (free bytes, margin 0) that `low` fits and `high` does not."""
    below, above = peak_of(predict(task, config, low)), peak_of(predict(task, config, high))
    assert below < above
    return (below + above) // 2


def test_the_policy_checkpoints_the_fewest_blocks_that_fit() -> None:
    task = _hf()
    runner = TorchTaskRunner(task)
    config = LONG  # no micro-batches to take: only checkpointing helps
    one, two = (Plan(checkpointing=True, checkpoint_blocks=k) for k in (1, 2))
    free = _between(task, config, two, one)
    policy = MemoryPolicy(resizes=["micro_batch", "selective_checkpointing"], margin=0.0)
    decision = choose_plan(runner, config, policy, CPU_CARD, free)
    assert isinstance(decision, RunAsPlanned), decision
    assert plan_key(decision.plan) == plan_key(two)
    assert rungs_of(decision.plan) == ["selective_checkpointing"]
    assert "rungs: selective_checkpointing" in decision.plan.reason
    assert "checkpoint the first 2 blocks" in decision.plan.reason
    assert decision.step_time is not None and decision.step_time.checkpointed_fraction == 0.5
    # The same card without the rung checkpoints every block: more recomputation.
    every = choose_plan(runner, config, MemoryPolicy(margin=0.0), CPU_CARD, free)
    assert isinstance(every, RunAsPlanned) and every.plan.checkpointing
    assert every.plan.checkpoint_blocks is None


def test_selective_checkpointing_is_cheaper_than_every_block_by_the_step_time_model() -> None:
    runner = TorchTaskRunner(_hf())
    config = LONG
    one = Plan(checkpointing=True, checkpoint_blocks=1)
    free = _between(_hf(), config, one, Plan())
    # Listed before or after checkpointing, selective checkpointing chooses the fewest blocks.
    for rungs in (["checkpointing", "selective_checkpointing"], ["selective_checkpointing"]):
        policy = MemoryPolicy.model_validate({"resizes": rungs, "margin": 0.0})
        decision = choose_plan(runner, config, policy, CPU_CARD, free)
        assert isinstance(decision, RunAsPlanned) and decision.plan.checkpoint_blocks == 1


COMBINED = [
    Plan(micro_batch=2, accumulation=2, checkpointing=True, checkpoint_blocks=1, chunked_loss=True),
    Plan(checkpointing=True, chunked_loss=True),
]


@pytest.mark.parametrize("plan", COMBINED, ids=["micro2-1-of-2-chunked", "every-chunked"])
def test_combined_rungs_are_predicted_to_the_byte(plan: Plan) -> None:
    task = _hf()
    prediction = predict(task, BIG_VOCAB, plan)
    assert prediction.method == "trace", prediction.reason
    assert prediction.peak_allocated_bytes == measured_cpu_peak(task, BIG_VOCAB, plan)


def test_the_policy_combines_rungs_only_when_none_fits_alone() -> None:
    task = _hf()
    runner = TorchTaskRunner(task)
    config = LONGER_BIG_VOCAB  # one sequence: no micro-batches to take
    combined = Plan(checkpointing=True, checkpoint_blocks=1, chunked_loss=True)
    alone = [Plan(checkpointing=True), Plan(chunked_loss=True)]
    smallest_alone = min(alone, key=lambda plan: peak_of(predict(task, config, plan)))
    free = _between(task, config, combined, smallest_alone)
    policy = MemoryPolicy(
        resizes=["micro_batch", "selective_checkpointing", "chunked_cross_entropy"], margin=0.0
    )
    decision = choose_plan(runner, config, policy, CPU_CARD, free)
    assert isinstance(decision, RunAsPlanned), decision
    assert plan_key(decision.plan) == plan_key(combined)
    assert rungs_of(decision.plan) == ["selective_checkpointing", "chunked_cross_entropy"]
    assert "rungs: selective_checkpointing, chunked_cross_entropy" in decision.plan.reason
    real = measured_cpu_peak(task, config, decision.plan)
    assert real == decision.prediction.peak_allocated_bytes <= free
    # Where a rung alone fits, it is taken: no combination is searched.
    roomy = peak_of(predict(task, config, smallest_alone))
    alone_fits = choose_plan(runner, config, policy, CPU_CARD, roomy)
    assert isinstance(alone_fits, RunAsPlanned) and len(rungs_of(alone_fits.plan)) == 1


def test_the_policy_takes_chunked_cross_entropy_when_only_it_fits() -> None:
    task = _hf()
    runner = TorchTaskRunner(task)
    config = LONG_BIG_VOCAB
    chunked = Plan(chunked_loss=True)
    free = _between(task, config, chunked, Plan(checkpointing=True))
    without = MemoryPolicy(resizes=["micro_batch", "checkpointing"], margin=0.0)
    assert isinstance(choose_plan(runner, config, without, CPU_CARD, free), HandBack)
    policy = MemoryPolicy(resizes=["micro_batch", "chunked_cross_entropy"], margin=0.0)
    decision = choose_plan(runner, config, policy, CPU_CARD, free)
    assert isinstance(decision, RunAsPlanned), decision
    assert plan_key(decision.plan) == plan_key(chunked)
    assert "rungs: chunked_cross_entropy" in decision.plan.reason
    assert decision.step_time is not None and decision.step_time.chunked_loss
    real = measured_cpu_peak(task, config, decision.plan)
    assert real == decision.prediction.peak_allocated_bytes <= free


def test_an_unknown_rung_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match=r"resizes\.1"):
        MemoryPolicy.model_validate({"resizes": ["micro_batch", "offload_everything"]})


def test_bf16_is_never_taken_unless_listed() -> None:
    task = _hf()
    runner = TorchTaskRunner(task)
    config = LONG
    free = _between(task, config, Plan(checkpointing=True, bf16=True), Plan(checkpointing=True))
    rungs: list[Any] = ["micro_batch", "selective_checkpointing", "checkpointing"]
    assert isinstance(
        choose_plan(runner, config, MemoryPolicy(resizes=rungs, margin=0.0), CPU_CARD, free),
        HandBack,
    )
    allowed = MemoryPolicy(resizes=[*rungs, "bf16"], margin=0.0)
    decision = choose_plan(runner, config, allowed, CPU_CARD, free)
    assert isinstance(decision, RunAsPlanned) and rungs_of(decision.plan) == [
        "checkpointing",
        "bf16",
    ]
