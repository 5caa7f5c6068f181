"""LoRA fine-tuning of hf-causal-lm through peft: the frozen base, the settings, exact predictions.

`peft.get_peft_model` cannot run under fake tensors (it moves the adapters with `Module.to`):
the predictor builds the model on meta and converts it (worker/predictor/conversion.py). Cost:
~30 s (tiny Llama and GPT-2 configs, two real CPU steps per exactness case).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from task_contract import check_task
from test_predictor import measured_cpu_peak

from vramtune.service.wire import Plan
from vramtune.worker.predictor import clear_cache, predict
from vramtune.worker.trial.steps import batch_feeder, build_for_plan, train_step
from vramtune.worker.trial.task import Task, TaskConfigError

pytest.importorskip("transformers", reason="pip install 'vramtune[hf]'")
pytest.importorskip("peft", reason="pip install 'vramtune[peft]'")

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
    "finetune": {"method": "lora", "r": 8, "lora_alpha": 16, "lora_dropout": 0.05},
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


def test_hf_causal_lm_with_lora_keeps_the_contract() -> None:
    check_task(
        _task(),
        {**LLAMA, "finetune": {"method": "lora", "r": 4}},
        bad_configs=[{**LLAMA, "lora_r": 0}, {**LLAMA, "finetune": {"method": "lora", "r": -1}}],
    )


def _lora_ranks(model: torch.nn.Module) -> set[int]:
    return {p.shape[0] for name, p in model.named_parameters() if "lora_A" in name}


def test_the_frozen_base_gets_no_gradients_or_optimizer_state() -> None:
    task = _task()
    model = task.build_model(LLAMA)
    optimizer = task.build_optimizer(model, LLAMA)
    batches = batch_feeder(task.batches(LLAMA, 6, CPU, seed=0))
    train_step(task, model, optimizer, batches, 6, Plan(), CPU)
    adapters = {n for n, p in model.named_parameters() if "lora_" in n}
    assert adapters and _lora_ranks(model) == {8}
    for name, parameter in model.named_parameters():
        assert parameter.requires_grad == (name in adapters), name
        assert (parameter.grad is not None) == (name in adapters), name
    with_state = {id(p) for p in optimizer.state}
    assert with_state == {id(p) for n, p in model.named_parameters() if n in adapters}


def test_hyperparameters_override_the_task_configs_lora_settings() -> None:
    task = _task()
    assert _lora_ranks(task.build_model({**LLAMA, "lora_r": 4})) == {4}
    settings = task.settings({**LLAMA, "lora_alpha": 32.0, "lora_dropout": 0.0})  # type: ignore[attr-defined]
    assert settings.lora().lora_alpha == 32.0 and settings.lora().lora_dropout == 0.0


def test_the_flat_form_the_study_wire_carries_builds_the_same_adapters() -> None:
    """The wire's task_config holds flat values only: `finetune: lora` and `lora_*` keys."""
    flat = {**LLAMA, "finetune": "lora", "lora_r": 4, "lora_target_modules": "q_proj, o_proj"}
    model = _task().build_model(flat)
    adapted = {
        n.split(".lora_A")[0].rsplit(".", 1)[1]
        for n, _ in model.named_parameters()
        if "lora_A" in n
    }
    assert adapted == {"q_proj", "o_proj"}
    assert _lora_ranks(model) == {4}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"finetune": None, "lora_r": 8}, r"lora_r: needs finetune: \{method: lora\}"),
        ({"finetune": {"method": "qlora"}}, r"finetune\.method"),
        ({"finetune": {"method": "lora", "r": 0}}, r"finetune\.r"),
        ({"finetune": {"method": "lora", "rank": 8}}, r"finetune\.rank"),
        ({"lora_dropout": 1.0}, r"lora_dropout"),
    ],
)
def test_bad_lora_settings_name_the_field(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(TaskConfigError, match=rf"hf-causal-lm: .*{message}"):
        _task().build_model({**LLAMA, **bad})


def test_without_peft_lora_fails_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "peft" else real_find_spec(name, *a),
    )
    task = _task()
    with pytest.raises(TaskConfigError, match=r"pip install 'vramtune\[peft\]'"):
        task.build_model(LLAMA)
    with pytest.raises(TaskConfigError, match=r"vramtune\[peft\]"):
        predict(task, LLAMA, Plan())
    # Full training does not need peft.
    assert predict(task, {**LLAMA, "finetune": None}, Plan()).method == "trace"


PLANS = [Plan(), Plan(checkpointing=True), Plan(bf16=True), Plan(micro_batch=3, accumulation=2)]


@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama-gqa", "gpt2-dropout"])
@pytest.mark.parametrize("plan", PLANS, ids=["asked", "checkpointing", "bf16", "micro3"])
def test_lora_prediction_is_exact_on_the_cpu_card(config: dict[str, Any], plan: Plan) -> None:
    task = _task()
    prediction = predict(task, config, plan)
    assert prediction.method == "trace", prediction.reason
    assert prediction.peak_allocated_bytes == measured_cpu_peak(task, config, plan)


def test_the_rank_is_a_shape_parameter() -> None:
    task = _task()
    low = predict(task, {**LLAMA, "lora_r": 8}, Plan())
    high = predict(task, {**LLAMA, "lora_r": 64}, Plan())
    assert high.breakdown["parameters"] > low.breakdown["parameters"]
    assert high.peak_allocated_bytes == measured_cpu_peak(task, {**LLAMA, "lora_r": 64}, Plan())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama-gqa", "gpt2-dropout"])
def test_lora_fake_cuda_prediction_is_close_to_the_measured_cuda_peak(
    config: dict[str, Any],
) -> None:
    """On the card: the model built on meta and converted to fake cuda, against real steps."""
    from vramtune.service.wire import CardInfo
    from vramtune.worker.predictor import measure_card_constants
    from vramtune.worker.trial.runner import CardSpec

    device = torch.device("cuda:0")
    card = CardSpec(
        info=CardInfo(model=torch.cuda.get_device_name(0), total_bytes=1, free_bytes=1),
        constants=measure_card_constants(device).model_dump(),
        device="cuda:0",
    )
    task, batch = _task(), int(config["batch_size"])
    prediction = predict(task, config, Plan(), card)
    assert prediction.method == "trace", prediction.reason
    torch.cuda.reset_peak_memory_stats(device)
    model = build_for_plan(task, config, Plan(), device)
    optimizer = task.build_optimizer(model, config)
    next_batch = batch_feeder(task.batches(config, batch, device, seed=0))
    for _ in range(2):
        train_step(task, model, optimizer, next_batch, batch, Plan(), device)
    measured = torch.cuda.max_memory_allocated(device)
    assert abs(prediction.peak_allocated_bytes - measured) <= 0.05 * measured
