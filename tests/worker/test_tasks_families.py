"""The model-family tasks: transformers causal LMs, timm and torchvision classifiers.

Each keeps the task contract, refuses what cannot be built with a message naming the field,
and is predicted to the byte on the CPU card. The vision tasks need a torchvision built for the
installed torch (README, "Model families"): where it does not import they are skipped.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

import pytest
import torch
from task_contract import check_task

from vramtune.service.wire import Plan
from vramtune.worker.device.memory import MemoryTracker
from vramtune.worker.predictor import clear_cache, predict
from vramtune.worker.tasks.registry import discover
from vramtune.worker.trial.steps import batch_feeder, build_for_plan, train_step
from vramtune.worker.trial.task import Task, TaskConfigError

CPU = torch.device("cpu")


def _vision_or_skip() -> None:
    try:
        importlib.import_module("torchvision")
    except Exception as error:  # a torchvision built for another torch raises at import
        pytest.skip(f"torchvision does not import here ({type(error).__name__}: {error})")


def _hf() -> Task:
    pytest.importorskip("transformers", reason="pip install 'vramtune[hf]'")
    from vramtune.worker.tasks.hf import HFCausalLMTask

    return HFCausalLMTask()


def _timm() -> Task:
    _vision_or_skip()
    pytest.importorskip("timm", reason="pip install 'vramtune[vision]'")
    from vramtune.worker.tasks.timm_image import TimmImageTask

    return TimmImageTask()


def _torchvision() -> Task:
    _vision_or_skip()
    from vramtune.worker.tasks.vision import TorchvisionImageTask

    return TorchvisionImageTask()


LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "seq_len": 16,
    "batch_size": 6,
    "corpus_chars": 20_000,
    "eval_windows": 4,
}
GPT2 = {**LLAMA, "model_type": "gpt2", "num_key_value_heads": None, "dropout": 0.1}


def test_hf_causal_lm_keeps_the_contract() -> None:
    check_task(
        _hf(),
        LLAMA,
        bad_configs=[
            {"hidden_size": 30, "num_attention_heads": 4},
            {"num_attention_heads": 4, "num_key_value_heads": 3},
            {"model_type": "bert"},
            {"vocab_size": 100},
            {"num_layers": 2},
        ],
    )


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"hidden_size": 30}, r"num_attention_heads: hidden_size \(30\) must be divisible"),
        ({"num_key_value_heads": 3}, r"num_key_value_heads: num_attention_heads \(4\) must be"),
        ({"model_type": "gpt2", "num_key_value_heads": 2}, r"gpt2 has no grouped-query"),
        ({"model_type": "bert"}, r"model_type"),
        ({"hidden_size": 12}, r"even head size for rotary"),
    ],
)
def test_hf_bad_shapes_name_the_field(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(TaskConfigError, match=rf"hf-causal-lm: .*{message}"):
        _hf().build_model({**LLAMA, **bad})


def _real_peak(task: Task, config: dict[str, Any], plan: Plan) -> int:
    """The tracked peak of two real training steps through the trainer's step."""
    micro = plan.micro_batch or config["batch_size"]
    batches = task.batches(config, micro, CPU, seed=0)  # data loaded before measuring
    tracker = MemoryTracker(device_type="cpu")
    with tracker:
        model = build_for_plan(task, config, plan, CPU)
        optimizer = task.build_optimizer(model, config)
        next_batch = batch_feeder(batches)
        for _ in range(2):
            loss = train_step(task, model, optimizer, next_batch, config["batch_size"], plan, CPU)
        del loss
    return tracker.peak_bytes


PLANS = [Plan(), Plan(checkpointing=True), Plan(bf16=True), Plan(micro_batch=3, accumulation=2)]


@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama-gqa", "gpt2-dropout"])
@pytest.mark.parametrize("plan", PLANS, ids=["asked", "checkpointing", "bf16", "micro3"])
def test_hf_prediction_is_exact_on_the_cpu_card(config: dict[str, Any], plan: Plan) -> None:
    task = _hf()
    clear_cache()
    prediction = predict(task, config, plan)
    assert prediction.method == "trace", prediction.reason
    assert prediction.peak_allocated_bytes == _real_peak(task, config, plan)


IMAGE = {"resolution": 32, "batch_size": 4}


# BatchNorm makes a micro-batch's gradient differ from the whole batch's: no accumulation check.
@pytest.mark.parametrize(
    ("make", "model_name", "accumulation"),
    [
        (_timm, "resnet18", False),
        (_timm, "vit_tiny_patch16_224", True),
        (_torchvision, "mobilenet_v3_small", False),
    ],
)
def test_image_tasks_keep_the_contract(make: Any, model_name: str, accumulation: bool) -> None:
    check_task(
        make(),
        {**IMAGE, "model_name": model_name},
        bad_configs=[{"resolution": 8}, {"model_name": "no such model!"}],
        accumulation=accumulation,
    )


@pytest.mark.parametrize(("make", "typo"), [(_timm, "resnet5O"), (_torchvision, "resnet5O")])
def test_an_unknown_model_name_names_the_field_and_close_matches(make: Any, typo: str) -> None:
    with pytest.raises(
        TaskConfigError, match=r"model_name: .* no classification model 'resnet5O'.*resnet50"
    ):
        make().build_model({**IMAGE, "model_name": typo})


def test_a_resolution_too_small_for_the_model_names_the_field() -> None:
    task = _torchvision()
    config = {**IMAGE, "model_name": "inception_v3"}
    # Inception's stem shrinks 32 px to less than its 3x3 kernels.
    model = task.build_model(config)
    with pytest.raises(TaskConfigError, match=r"^resolution: torchvision model cannot run"):
        task.loss(model, task.example_batch(config, 2, CPU))


@pytest.mark.parametrize(
    ("make", "model_name"), [(_timm, "resnet18"), (_torchvision, "mobilenet_v3_small")]
)
@pytest.mark.parametrize("plan", PLANS[:3], ids=["asked", "checkpointing", "bf16"])
def test_image_prediction_is_exact_on_the_cpu_card(make: Any, model_name: str, plan: Plan) -> None:
    task = make()
    config = {**IMAGE, "model_name": model_name}
    clear_cache()
    prediction = predict(task, config, plan)
    assert prediction.method == "trace", prediction.reason
    assert prediction.peak_allocated_bytes == _real_peak(task, config, plan)


def test_a_missing_extra_leaves_the_task_out_instead_of_failing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real_find_spec(name, *a),
    )
    monkeypatch.delitem(sys.modules, "vramtune.worker.tasks.hf", raising=False)
    found = discover()
    assert "hf-causal-lm" not in found.runners
    assert "hf-causal-lm" not in found.errors
    assert "vramtune[hf]" in found.unavailable["hf-causal-lm"]
    assert "char-transformer" in found.runners


@pytest.mark.parametrize("model_name", ["convnext_tiny", "efficientnet_b0"])
def test_timm_models_with_stagewise_schedules_build_under_fake_tensors(model_name: str) -> None:
    # convnext computes its drop-path rates with linspace(...).split(depths) on the host.
    task = _timm()
    config = {**IMAGE, "model_name": model_name, "batch_size": 2}
    clear_cache()
    prediction = predict(task, config, Plan())
    assert prediction.method == "trace", prediction.reason
    assert prediction.peak_allocated_bytes == _real_peak(task, config, Plan())


def test_batch_norm_under_bf16_keeps_float32_statistics_in_the_prediction() -> None:
    # A BatchNorm after an autocast conv: real kernels save mean and inverse std in float32,
    # the meta kernel in bf16 (worker/predictor/opmodel.py); at batch 32 activations set the peak.
    task = _torchvision()
    config = {"model_name": "mobilenet_v3_small", "resolution": 64, "batch_size": 32}
    clear_cache()
    prediction = predict(task, config, Plan(bf16=True))
    assert prediction.peak_allocated_bytes == _real_peak(task, config, Plan(bf16=True))


def test_layer_norm_under_bf16_keeps_float32_statistics_in_the_prediction() -> None:
    # timm's ConvNeXt: LayerNorm fed bf16 with float32 weights (worker/predictor/opmodel.py).
    task = _timm()
    config = {"model_name": "convnext_tiny", "resolution": 64, "batch_size": 32}
    clear_cache()
    prediction = predict(task, config, Plan(bf16=True))
    assert prediction.peak_allocated_bytes == _real_peak(task, config, Plan(bf16=True))
