"""QLoRA: hf-causal-lm's LoRA on a frozen base stored quantized by torchao (int8 or nf4).

Both kinds run on the CPU, so the prediction (the model built on meta, its quantized weights
converted to fake tensors through their own flatten/unflatten, worker/predictor/conversion.py)
is checked against real CPU runs to the byte. The storage level is checked too: each quantized
weight holds its packed bytes, in the real model and in the predictor's fake one. Cost: ~60 s.
"""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from test_predictor import measured_cpu_peak

from vramtune.service.wire import Plan
from vramtune.worker.device.memory import MemoryTracker
from vramtune.worker.predictor import clear_cache, predict
from vramtune.worker.trial.steps import batch_feeder, build_for_plan, train_step
from vramtune.worker.trial.task import Task, TaskConfigError

pytest.importorskip("peft", reason="pip install 'vramtune[peft]'")
pytest.importorskip("torchao", reason="pip install 'vramtune[qlora]'")

LORA = {"method": "lora", "r": 8, "lora_alpha": 16, "lora_dropout": 0.05}
# Widths whose every weight is whole NF4 blocks (64 weights); GQA's k_proj has 128 blocks.
LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "seq_len": 16,
    "batch_size": 4,
    "corpus_chars": 20_000,
    "eval_windows": 4,
    "finetune": LORA,
}
GPT2 = {**LLAMA, "model_type": "gpt2", "num_key_value_heads": None, "dropout": 0.1}
CPU = torch.device("cpu")


def _task() -> Task:
    from vramtune.worker.tasks.hf import HFCausalLMTask

    return HFCausalLMTask()


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    clear_cache()
    yield
    clear_cache()


def _quantized_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return {name: p for name, p in model.named_parameters() if is_traceable_wrapper_subclass(p)}


def _packed_bytes(kind: str, weight: torch.Tensor) -> int:
    """What torchao stores for one weight of `weight.shape`, from its format alone."""
    rows, elements = weight.shape[0], weight.numel()
    if kind == "int8":
        return elements + rows * 4 + rows  # int8 codes, a float scale and an int8 zero per row
    blocks = elements // 64
    scaler_block = min(256, blocks & -blocks)  # the largest power of two dividing, at most 256
    groups = blocks // scaler_block
    # With one group of scales, torchao's factor is a view of a buffer of one float per block,
    # which it keeps whole; with several, a tensor of its own.
    factors = blocks * 4 if groups == 1 else groups * 4
    # 4-bit codes; an int8 scale per block; the float factor of each group of scales; their
    # float mean; the 16-value NF4 table.
    return elements // 2 + blocks + factors + 4 + 16 * 4


def _storage_bytes(tensor: torch.Tensor) -> int:
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    return sum(getattr(tensor, name).untyped_storage().nbytes() for name in names)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama-gqa", "gpt2"])
def test_the_base_is_stored_packed_and_the_adapters_train(
    kind: str, config: dict[str, Any]
) -> None:
    """Every linear layer but the output one holds its packed bytes; only adapters train."""
    task = _task()
    settings = {**config, "quantized_base": kind}
    model = task.build_model(settings)
    quantized = _quantized_weights(model)
    layers = 7 if config["model_type"] == "llama" else 4  # q k v o gate up down; c_attn c_proj x2
    assert len(quantized) == layers * int(config["num_hidden_layers"])
    assert not any("lm_head" in name for name in quantized)
    for name, weight in quantized.items():
        assert not weight.requires_grad, name
        assert _storage_bytes(weight) == _packed_bytes(kind, weight), name
        assert _storage_bytes(weight) < weight.numel() * 4 / (3 if kind == "int8" else 6), name
    optimizer = task.build_optimizer(model, settings)
    batches = batch_feeder(task.batches(settings, 4, CPU, seed=0))
    loss = train_step(task, model, optimizer, batches, 4, Plan(), CPU)
    assert torch.isfinite(loss)
    trained = {n for n, p in model.named_parameters() if p.grad is not None}
    assert trained and all("lora_" in name for name in trained)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_the_predictors_fake_base_holds_the_same_packed_storage(kind: str) -> None:
    """The model the trace runs (built on meta, converted to fake tensors) holds what the real
    model holds, weight by weight: a quantized weight converted as a plain float tensor of its
    shape would count 4-8x its packed bytes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramtune.worker.predictor.conversion import build_for_trace

    task = _task()
    settings = {**LLAMA, "quantized_base": kind}
    models, live = [], []
    for fake in (False, True):
        tracker = MemoryTracker(device_type="cpu")
        with FakeTensorMode() if fake else nullcontext(), tracker:
            model = (build_for_trace if fake else build_for_plan)(task, settings, Plan(), CPU)
            gc.collect()
            live.append(tracker.live_bytes)  # what outlives the build: the model's tensors
        models.append(model)
    real, traced = (_quantized_weights(model) for model in models)
    assert real and real.keys() == traced.keys()
    for name, weight in real.items():
        assert type(traced[name]) is type(weight), name
        assert traced[name].device == CPU, name
        assert _storage_bytes(traced[name]) == _storage_bytes(weight), name
    assert live[1] == live[0]
    float_base = predict(task, LLAMA, Plan()).breakdown["parameters"]
    assert live[0] < float_base


def test_the_int8_base_saves_its_int8_weight_not_a_float_copy() -> None:
    """torchao's int8 `linear` saves a float copy of each weight for backward, which made the
    int8 base's peak higher than the float base's; the base layers dequantize again in
    backward instead, with the same input gradient, and the peak falls below the float's."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from vramtune.worker.tasks.hf import Int8BaseLinear

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32)
    quantize_(layer, Int8WeightOnlyConfig())
    inputs = torch.randn(5, 64, requires_grad=True)
    torch.nn.functional.linear(inputs, layer.weight, layer.bias).sum().backward()
    expected, inputs.grad = inputs.grad, None
    layer.__class__ = Int8BaseLinear
    layer(inputs).sum().backward()
    assert inputs.grad is not None and expected is not None
    torch.testing.assert_close(inputs.grad, expected)

    task = _task()
    peaks = {
        kind: measured_cpu_peak(task, {**LLAMA, "quantized_base": kind}, Plan())
        for kind in ("none", "int8")
    }
    assert peaks["int8"] < peaks["none"], peaks


def test_a_cuda_trace_keeps_of_the_build_only_what_outlives_it() -> None:
    """A GPU run builds the model on the host and moves it: the card never holds the float
    base before quantization (nor what peft's failed build under fake tensors made), so an
    emulated-CUDA trace drops them. Wide layers and one short window: the float base outweighs
    the QLoRA step's peak."""
    from vramtune.worker.predictor.trace import CPU_TARGET, EMULATED_CUDA_TARGET, trace_training

    task = _task()
    wide = {**LLAMA, "hidden_size": 512, "intermediate_size": 1024, "seq_len": 4, "batch_size": 1}
    float_base = predict(task, {**wide, "finetune": None}, Plan()).breakdown["parameters"]
    settings = {**wide, "quantized_base": "int8"}
    on_card = trace_training(task, settings, Plan(), EMULATED_CUDA_TARGET)
    assert on_card.peak_bytes < float_base
    allocated = {storage for storage, change in on_card.events if change > 0}
    assert all(storage in allocated for storage, change in on_card.events if change < 0)
    # On the CPU card the real run builds there too: the failed build's float base is kept.
    assert trace_training(task, settings, Plan(), CPU_TARGET).peak_bytes >= float_base


PLANS = [Plan(), Plan(checkpointing=True), Plan(micro_batch=2, accumulation=2)]


@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama-gqa", "gpt2-dropout"])
@pytest.mark.parametrize("plan", PLANS, ids=["asked", "checkpointing", "micro2"])
def test_qlora_prediction_is_exact_on_the_cpu_card(
    kind: str, config: dict[str, Any], plan: Plan
) -> None:
    task = _task()
    settings = {**config, "quantized_base": kind}
    prediction = predict(task, settings, plan)
    assert prediction.method == "trace", prediction.reason
    assert prediction.peak_allocated_bytes == measured_cpu_peak(task, settings, plan)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"quantized_base": "int4"}, r"quantized_base: Input should be 'none', 'int8' or 'nf4'"),
        (
            {"finetune": {**LORA, "quantized_base": "fp4"}},
            r"finetune\.quantized_base: Input should be",
        ),
        ({"finetune": None, "quantized_base": "nf4"}, r"quantized_base: needs finetune"),
        (
            {"hidden_size": 20, "num_attention_heads": 2, "quantized_base": "nf4"},
            r"finetune\.quantized_base nf4: model\.layers\.0\.self_attn\.q_proj's weight has "
            r"400 elements, not a multiple of 64",
        ),
    ],
)
def test_bad_quantized_base_settings_name_the_field(bad: dict[str, Any], message: str) -> None:
    task = _task()
    with pytest.raises(TaskConfigError, match=rf"hf-causal-lm: .*{message}"):
        task.build_model({**LLAMA, **bad})
    with pytest.raises(TaskConfigError, match=message):
        predict(task, {**LLAMA, **bad}, Plan())


def test_without_torchao_a_quantized_base_fails_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torchao" else real_find_spec(name, *a),
    )
    task = _task()
    expected = r"finetune\.quantized_base int8 needs torchao: pip install 'vramtune\[qlora\]'"
    with pytest.raises(TaskConfigError, match=expected):
        task.build_model({**LLAMA, "quantized_base": "int8"})
    with pytest.raises(TaskConfigError, match=expected):
        predict(task, {**LLAMA, "quantized_base": "int8"}, Plan())
    # A float base does not need torchao.
    assert predict(task, {**LLAMA, "quantized_base": "none"}, Plan()).method == "trace"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama-gqa", "gpt2-dropout"])
def test_qlora_fake_cuda_prediction_is_close_to_the_measured_cuda_peak(
    kind: str, config: dict[str, Any]
) -> None:
    """On the card: the quantized model built on meta and converted to fake cuda (its packed
    weights on the card), against two real steps of the model quantized on the host and
    moved; within 5 % like the float-base LoRA check, and the parameters to the byte."""
    from vramtune.service.wire import CardInfo
    from vramtune.worker.predictor import measure_card_constants
    from vramtune.worker.trial.runner import CardSpec

    device = torch.device("cuda:0")
    card = CardSpec(
        info=CardInfo(model=torch.cuda.get_device_name(0), total_bytes=1, free_bytes=1),
        constants=measure_card_constants(device).model_dump(),
        device="cuda:0",
    )
    task, settings = _task(), {**config, "quantized_base": kind}
    batch = int(settings["batch_size"])
    prediction = predict(task, settings, Plan(), card)
    assert prediction.method == "trace", prediction.reason
    torch.cuda.reset_peak_memory_stats(device)
    model = build_for_plan(task, settings, Plan(), device)
    for weight in _quantized_weights(model).values():
        assert all(getattr(weight, n).is_cuda for n in weight.__tensor_flatten__()[0])
    optimizer = task.build_optimizer(model, settings)
    next_batch = batch_feeder(task.batches(settings, batch, device, seed=0))
    for _ in range(2):
        train_step(task, model, optimizer, next_batch, batch, Plan(), device)
    measured = torch.cuda.max_memory_allocated(device)
    assert abs(prediction.peak_allocated_bytes - measured) <= 0.05 * measured
