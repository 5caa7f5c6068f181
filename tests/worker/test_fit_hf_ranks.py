"""`vramtune.fit` on a local Hugging Face config, per rank, with the CUDA context and progress:
each against the path it reuses (a real CPU run, the ladder's per-rank trace)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from task_contract import run_trial
from torch import nn

import vramtune
from vramtune.service.wire import Plan
from vramtune.worker.fit import hf_config
from vramtune.worker.fit.adapter import ModuleTask
from vramtune.worker.fit.cards import CUDA_CONTEXT_BYTES
from vramtune.worker.predictor import clear_cache
from vramtune.worker.predictor.distributed import trace_rank

transformers = pytest.importorskip("transformers")

HF_CONFIG = {"batch_size": 4, "seq_len": 16}


@pytest.fixture(autouse=True)
def _fresh_cache() -> Iterator[None]:
    clear_cache()
    yield
    clear_cache()


def tiny_llama(folder: Path) -> Path:
    """A two-layer Llama config.json of hidden size 32, as a model repository holds it."""
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(folder)
    return folder / "config.json"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def example() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 32), torch.randint(0, 10, (8,))


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_an_hf_config_is_the_real_cpu_runs_peak_with_the_models_own_loss(tmp_path: Path) -> None:
    path = tiny_llama(tmp_path)
    result = vramtune.fit(f"hf:{path}", config=HF_CONFIG, cards=["T4"], device="cpu")
    task = hf_config.hf_task(f"hf:{path}", HF_CONFIG["seq_len"])
    measured = run_trial(task, HF_CONFIG, steps=2).measured
    assert result.task == "LlamaForCausalLM" and result.method == "trace"
    assert result.peak_bytes == measured.training_peak_bytes
    assert result.config == HF_CONFIG and result.fits("T4")
    # The folder, or the config object itself, is the same model.
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    same = vramtune.fit(loaded, config=HF_CONFIG, cards=[], device="cpu")
    assert same.peak_bytes == result.peak_bytes


def test_the_head_is_the_one_the_config_names() -> None:
    def head(architectures: list[str] | None, family: str = "bert") -> str:
        config = transformers.AutoConfig.for_model(family, architectures=architectures)
        return hf_config._auto_class(config)

    assert head(["BertForSequenceClassification"]) == "AutoModelForSequenceClassification"
    assert head(["BertForMaskedLM"]) == "AutoModelForMaskedLM"
    assert head(["BertModel"]) == "AutoModel"
    assert head(["GPT2LMHeadModel"], "gpt2") == "AutoModelForCausalLM"
    assert head(None, "llama") == "AutoModelForCausalLM"
    # A head the family lacks falls back to one it has.
    assert head(["T5ForSequenceClassification"], "t5") == "AutoModelForSequenceClassification"
    assert head(["LlamaForMaskedLM"], "llama") == "AutoModelForCausalLM"


def test_a_bad_hf_config_names_the_argument(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model: no Hugging Face config at"):
        vramtune.fit(f"hf:{tmp_path / 'missing.json'}", config=HF_CONFIG)
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match=r"model: .* is not a config transformers can read"):
        vramtune.fit(f"hf:{broken}", config=HF_CONFIG)
    path = tiny_llama(tmp_path / "llama")
    with pytest.raises(ValueError, match="config: seq_len"):
        vramtune.fit(f"hf:{path}", config={"batch_size": 4})
    with pytest.raises(ValueError, match="config: a Hugging Face model reads"):
        vramtune.fit(f"hf:{path}", config={**HF_CONFIG, "width": 3})
    with pytest.raises(ValueError, match="batch_size: a whole number"):
        vramtune.fit(f"hf:{path}", config={"seq_len": 16})


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_ranks_are_the_ladders_own_per_rank_trace(strategy: str) -> None:
    x, y = example()
    result = vramtune.fit(
        Net(), (x, y), loss=cross_entropy, cards=[], device="cpu", world_size=2, strategy=strategy
    )
    task = ModuleTask(Net(), (x, y), loss=cross_entropy)
    wrapper = "ddp" if strategy == "ddp" else "fsdp"
    plan = Plan(world_size=2, strategy=wrapper)
    traced = trace_rank(task, {"batch_size": 8}, plan, wrapper, 2)
    assert (result.world_size, result.strategy) == (2, wrapper)
    assert result.peak_bytes == traced.allocated_bytes
    assert result.breakdown == traced.breakdown and result.evaluation_bytes is None


def test_bad_ranks_name_themselves() -> None:
    x, y = example()
    with pytest.raises(ValueError, match="world_size: the batch of 8 does not split over 3"):
        vramtune.fit(Net(), (x, y), world_size=3, strategy="ddp")
    with pytest.raises(ValueError, match="strategy: 'ddp' or 'fsdp2', got 'zero3'"):
        vramtune.fit(Net(), (x, y), world_size=2, strategy="zero3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy: give one"):
        vramtune.fit(Net(), (x, y), world_size=2)
    with pytest.raises(ValueError, match="world_size: a whole number of ranks"):
        vramtune.fit(Net(), (x, y), world_size=0)


def test_the_cuda_context_is_counted_against_each_card_and_progress_is_told() -> None:
    told: list[str] = []
    x, y = example()
    asked = vramtune.fit(Net(), (x, y), loss=cross_entropy, cards=[], progress=told.append)
    assert told == ["[1/1] the step...", "[1/1] the step: tracing batch 8..."]
    assert asked.cuda_context_bytes == CUDA_CONTEXT_BYTES
    assert asked.card_bytes == asked.peak_bytes + CUDA_CONTEXT_BYTES
    exact, short = f"{asked.card_bytes}B", f"{asked.card_bytes - 1}B"
    told.clear()
    result = vramtune.fit(
        Net(), (x, y), loss=cross_entropy, cards=[exact, short], resizes=(), progress=told.append
    )
    # The second card searches for its largest micro-batch: each trace of it is told.
    assert f"[3/3] {short}: tracing micro-batch 1 of 8..." in told
    assert [c.verdict for c in result.cards] == ["fits", "does not fit"]
    assert result.cards[1].short_by_bytes == 1
    # The CPU has no context: the peak alone is what it needs.
    cpu = vramtune.fit(Net(), (x, y), loss=cross_entropy, cards=[], device="cpu")
    assert cpu.cuda_context_bytes == 0 and cpu.card_bytes == cpu.peak_bytes


def test_qlora_on_an_hf_config_is_the_real_cpu_runs_peak(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("torchao")
    from vramtune.worker.tasks.hf import LoRASettings

    path = tiny_llama(tmp_path)
    lora = {"r": 8, "quantized_base": "nf4"}
    result = vramtune.fit(f"hf:{path}", config=HF_CONFIG, cards=[], device="cpu", lora=lora)
    settings = LoRASettings.model_validate(lora)
    task = hf_config.hf_task(f"hf:{path}", HF_CONFIG["seq_len"], lora=settings)
    measured = run_trial(task, HF_CONFIG, steps=2).measured
    assert result.task == "LlamaForCausalLM + LoRA r=8, nf4 base" and result.method == "trace"
    assert result.peak_bytes == measured.training_peak_bytes


def test_bad_lora_names_itself(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    path = tiny_llama(tmp_path / "llama")
    with pytest.raises(ValueError, match="lora: r: Input should be greater than or equal to 1"):
        vramtune.fit(f"hf:{path}", config=HF_CONFIG, lora={"r": 0})
    with pytest.raises(ValueError, match="lora: adapters go on a Hugging Face config"):
        vramtune.fit(Net(), example(), lora={"r": 8})
    classifier = transformers.BertConfig(architectures=["BertForSequenceClassification"])
    with pytest.raises(ValueError, match="lora: adapters go on a causal LM here"):
        vramtune.fit(classifier, config=HF_CONFIG, lora={"r": 8})


def test_two_models_of_one_class_are_two_predictions() -> None:
    x = torch.randn(8, 32)

    def wide(width: int) -> nn.Module:
        return nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, 10))

    narrow = vramtune.fit(wide(64), (x,), cards=[], device="cpu")
    broad = vramtune.fit(wide(4096), (x,), cards=[], device="cpu")  # no cache cleared between
    assert broad.breakdown["parameters"] > 30 * narrow.breakdown["parameters"]
