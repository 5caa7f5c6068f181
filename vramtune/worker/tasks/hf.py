"""`hf-causal-lm`: a Hugging Face transformers causal LM, built from its config alone.

The model is `AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, ...))`: GPT-2,
Llama, Qwen2 or Mistral, at the shapes the study samples or fixes, with SDPA attention, random
initial weights and nothing downloaded. It trains on the char-transformer's corpus (the stdlib's
own source as ASCII codes, worker/tasks/charlm.py); a vocabulary larger than 128 (GPT-2's 50,257)
only adds rows the data never uses. Checkpointing is transformers' own
`gradient_checkpointing_enable` (non-reentrant). The metric is the held-out loss in nats per
character. Needs ``pip install 'vramtune[hf]'``.

LoRA fine-tuning wraps the model with `peft.get_peft_model`; the base is frozen, so it gets no
gradients and no optimizer state. In the task_config, `finetune: {method: lora, r, lora_alpha,
lora_dropout, target_modules}`, or `finetune: lora` with the flat `lora_r`, `lora_alpha`,
`lora_dropout`, `lora_target_modules` (comma-separated): the study wire carries only flat
values, and these may be hyperparameters (they take precedence over the mapping's). Needs
``pip install 'vramtune[peft]'``; without peft a configuration that asks for LoRA fails with a
TaskConfigError naming the extra.

QLoRA: `finetune.quantized_base` (flat: `quantized_base`) stores the frozen base's linear
layers quantized before peft wraps them, through torchao: `int8` (weight-only int8, one scale
per output row: `Int8WeightOnlyConfig`) or `nf4` (QLoRA's 4-bit NormalFloat with double-quantized
scales: `to_nf4`); `none` (the default) keeps them in float. The output layer stays in float
(as bitsandbytes' QLoRA keeps it), and GPT-2's Conv1D layers become the nn.Linear layers they
compute (weights transposed) so that torchao and peft treat them as any other family's.
Backward saves the quantized weights only (`Int8BaseLinear` for int8, torchao's own NF4
`linear`). Both kinds run on the CPU, so their prediction is checked against real CPU runs.
Needs ``pip install 'vramtune[qlora]'``.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal
from unittest import mock

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from vramtune.common.task_rules import BYTE_VOCAB, LORA_OVERRIDES, hf_problems
from vramtune.worker.tasks.charlm import held_out_loss, training_windows
from vramtune.worker.tasks.common import parse_config
from vramtune.worker.tasks.extras import load, require
from vramtune.worker.trial.repeated import repeated
from vramtune.worker.trial.task import Batch, Config, Metric, TaskConfigError

NAME = "hf-causal-lm"
require(NAME, "hf", "transformers")


LORA_FIELDS = {"lora_r": "r", "lora_target_modules": "target_modules"}
"""The flat names whose LoRASettings field is named otherwise."""


class LoRASettings(BaseModel):
    """Low-rank adapters on the frozen model (peft's `LoraConfig` names)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["lora"] = "lora"
    r: int = Field(8, ge=1, le=65536, description="The adapters' rank.")
    lora_alpha: float = Field(16.0, gt=0, le=1e6, description="Scale: lora_alpha / r.")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | None = Field(
        None, min_length=1, description="Module names to adapt; None: peft's default per family."
    )

    quantized_base: Literal["none", "int8", "nf4"] = Field(
        "none", description="The frozen base's linear layers: float, torchao int8 or nf4 (QLoRA)."
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        return [name.strip() for name in value.split(",")] if isinstance(value, str) else value


class HFCausalLMConfig(BaseModel):
    """The tunable and fixed settings of a transformers causal LM (transformers' own names)."""

    model_config = ConfigDict(extra="forbid")

    model_type: Literal["gpt2", "llama", "qwen2", "mistral"] = "llama"
    num_hidden_layers: int = Field(2, ge=1, le=256)
    hidden_size: int = Field(64, ge=1, le=65536)
    num_attention_heads: int = Field(4, ge=1, le=1024)
    num_key_value_heads: int | None = Field(
        None, ge=1, le=1024, description="Grouped-query attention (not gpt2); None: one per head."
    )
    intermediate_size: int | None = Field(
        None, ge=1, le=262144, description="MLP width; None: 4 x hidden_size."
    )
    seq_len: int = Field(64, ge=2, le=65536)
    vocab_size: int = Field(BYTE_VOCAB, ge=1, le=1_000_000)
    tie_word_embeddings: bool | None = Field(None, description="None: the family's default.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Attention (and gpt2's) dropout.")
    batch_size: int = Field(16, ge=1, le=10**7)
    lr: float = Field(1e-3, gt=0, le=10)
    weight_decay: float = Field(0.01, ge=0, le=10)
    corpus_chars: int = Field(1_000_000, ge=10_000, le=100_000_000)
    eval_windows: int = Field(64, ge=1, le=100_000)
    seed: int = Field(0, description="Seeds the weights, dropout and the order of windows.")
    finetune: LoRASettings | None = Field(None, description="None: train every parameter.")
    lora_r: int | None = Field(None, ge=1, le=65536, description="Overrides finetune.r.")
    lora_alpha: float | None = Field(None, gt=0, le=1e6, description="Overrides its lora_alpha.")
    lora_dropout: float | None = Field(None, ge=0.0, lt=1.0, description="Overrides its dropout.")
    lora_target_modules: str | None = Field(
        None, min_length=1, max_length=4096, description="Overrides its target_modules (a,b,c)."
    )
    quantized_base: Literal["none", "int8", "nf4"] | None = Field(
        None, description="Overrides finetune.quantized_base."
    )

    @field_validator("finetune", mode="before")
    @classmethod
    def _method_alone(cls, value: object) -> object:
        return {"method": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _buildable(self) -> HFCausalLMConfig:
        for field, message in hf_problems(self.model_dump()):
            raise ValueError(f"{field}: {message}")
        return self

    def lora(self) -> LoRASettings | None:
        """The LoRA settings with the hyperparameters' overrides, or None (full training)."""
        if self.finetune is None:
            return None
        overrides = {
            LORA_FIELDS.get(name, name): getattr(self, name)
            for name in LORA_OVERRIDES
            if getattr(self, name) is not None
        }
        return LoRASettings.model_validate({**self.finetune.model_dump(), **overrides})

    def transformers_config(self) -> Any:
        """The family's `PretrainedConfig` at these shapes (no cache: a training run)."""
        transformers = load(NAME, "hf", "transformers")
        intermediate = self.intermediate_size or 4 * self.hidden_size
        tied = (
            {}
            if self.tie_word_embeddings is None
            else {"tie_word_embeddings": self.tie_word_embeddings}
        )
        # Token ids inside the vocabulary: GPT-2's defaults (50256) are outside a byte vocab.
        ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
        if self.model_type == "gpt2":
            shapes: dict[str, Any] = {
                "n_layer": self.num_hidden_layers,
                "n_embd": self.hidden_size,
                "n_head": self.num_attention_heads,
                "n_inner": intermediate,
                "n_positions": self.seq_len,
                "resid_pdrop": self.dropout,
                "embd_pdrop": self.dropout,
                "attn_pdrop": self.dropout,
            }
        else:
            shapes = {
                "num_hidden_layers": self.num_hidden_layers,
                "hidden_size": self.hidden_size,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads or self.num_attention_heads,
                "intermediate_size": intermediate,
                "max_position_embeddings": self.seq_len,
                "attention_dropout": self.dropout,
            }
        return transformers.AutoConfig.for_model(
            self.model_type, vocab_size=self.vocab_size, use_cache=False, **shapes, **ids, **tied
        )


class HFCausalLMTask:
    """A transformers causal LM (GPT-2, Llama, Qwen2, Mistral) from its config, on stdlib text."""

    name = NAME
    batch_size_param = "batch_size"
    shape_params = frozenset(
        {
            "model_type",
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "seq_len",
            "vocab_size",
            "tie_word_embeddings",
            "dropout",  # p = 0 saves no masks
            "finetune",
            "lora_r",
            "lora_dropout",  # p = 0: peft uses no dropout module
            "lora_target_modules",
            "quantized_base",
        }
    )
    metric = Metric("val_loss", "minimize")

    def settings(self, config: Config) -> HFCausalLMConfig:
        """The validated configuration (LoRA without peft installed, or a quantized base without
        torchao, is a TaskConfigError naming the extra)."""
        settings = parse_config(self.name, HFCausalLMConfig, config)
        lora = settings.lora()
        if lora is not None and importlib.util.find_spec("peft") is None:
            raise TaskConfigError(
                f"{self.name}: finetune.method lora needs peft: pip install 'vramtune[peft]'"
            )
        quantized = "none" if lora is None else lora.quantized_base
        if quantized != "none" and importlib.util.find_spec("torchao") is None:
            raise TaskConfigError(
                f"{self.name}: finetune.quantized_base {quantized} needs torchao: "
                "pip install 'vramtune[qlora]'"
            )
        return settings

    def build_model(self, config: Config) -> nn.Module:
        """A randomly initialised model of the configured family and shapes, SDPA attention;
        wrapped in LoRA adapters (the base frozen) when the configuration asks for them."""
        settings = self.settings(config)
        transformers = load(NAME, "hf", "transformers")
        torch.manual_seed(settings.seed)
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(
            settings.transformers_config(), attn_implementation="sdpa"
        )
        lora = settings.lora()
        if lora is None:
            return model
        return with_finetune(model, lora, conv1d=settings.model_type == "gpt2")

    def build_optimizer(self, model: nn.Module, config: Config) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters (a frozen base keeps no state); foreach spelled
        out so CPU runs allocate what CUDA runs (and the trace) do."""
        settings = self.settings(config)
        trainable = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(
            trainable, lr=settings.lr, weight_decay=settings.weight_decay, foreach=True
        )

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        """Random codes of the real batches' shapes."""
        shape = (micro_batch, self.settings(config).seq_len)
        return (
            torch.randint(0, BYTE_VOCAB, shape, device=device),
            torch.randint(0, BYTE_VOCAB, shape, device=device),
        )

    def batches(
        self, config: Config, micro_batch: int, device: torch.device, seed: int
    ) -> Iterator[Batch]:
        """Non-overlapping training windows of the stdlib corpus in seeded epochs."""
        settings = self.settings(config)
        return training_windows(
            self.name, settings.corpus_chars, settings.seq_len, micro_batch, device, seed
        )

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean cross-entropy per character (targets are the next codes, already shifted); in
        chunks of tokens when the plan's chunked_cross_entropy rung asked for it."""
        codes, targets = batch
        if getattr(model, CHUNKED_LOSS, False):
            return _chunked_loss(model, codes, targets)
        with _unpacked_sequences():
            logits = model(input_ids=codes).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def enable_chunked_loss(self, model: nn.Module) -> bool:
        """Compute this model's loss without its whole B x T x V logits (`_chunked_loss`)."""
        setattr(model, CHUNKED_LOSS, True)
        return True

    def checkpoint_block_count(self, config: Config) -> int:
        """The decoder layers, the blocks selective checkpointing chooses among."""
        return self.settings(config).num_hidden_layers

    def evaluate(self, model: nn.Module, config: Config, device: torch.device) -> float:
        """Mean held-out loss over the first `eval_windows` windows."""
        settings = self.settings(config)
        return held_out_loss(
            self.name,
            lambda batch: self.loss(model, batch),
            settings.corpus_chars,
            settings.seq_len,
            settings.eval_windows,
            settings.batch_size,
            device,
        )

    def enable_checkpointing(self, model: nn.Module, blocks: int | None = None) -> bool:
        """transformers' own activation checkpointing (non-reentrant) of every decoder layer,
        or of the first `blocks` of them (selective checkpointing).

        `gradient_checkpointing_enable`, named `activation_checkpointing_enable` since
        transformers 5.2x (the old name warns). Each layer checks its own
        `gradient_checkpointing` flag, so switching it off past `blocks` keeps the others'.
        """
        kwargs = {"use_reentrant": False}
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]
        if blocks is not None:
            # The decoder model carries the flag too: only the layers are blocks.
            layer_type = load(NAME, "hf", "transformers.modeling_layers").GradientCheckpointingLayer
            layers = [m for m in model.modules() if isinstance(m, layer_type)]
            for layer in layers[blocks:]:
                layer.gradient_checkpointing = False
        return True

    def checkpoint_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        """Not used: `enable_checkpointing` turns on transformers' own."""
        return ()


def with_finetune(model: nn.Module, lora: LoRASettings, conv1d: bool) -> nn.Module:
    """`model` in LoRA adapters, the base frozen; for QLoRA its linear layers quantized first
    (GPT-2's Conv1D layers, `conv1d`, made the nn.Linear layers torchao quantizes). Also the
    path of `vramtune.fit`'s ``lora=`` on a Hugging Face config."""
    if lora.quantized_base != "none":
        if conv1d:
            _conv1d_as_linear(model)
            conv1d = False
        _quantize_base(model, lora.quantized_base)
    return _with_lora(model, lora, conv1d)


def _with_lora(model: nn.Module, lora: LoRASettings, conv1d: bool) -> nn.Module:
    """`peft.get_peft_model` with these settings: adapters trainable, everything else frozen.
    (`conv1d`: GPT-2's layers store their weights transposed, which peft must be told.)

    peft moves the adapters with `Module.to`, which fake parameters refuse: the predictor then
    builds the model on meta and converts it (vramtune/worker/predictor/conversion.py).
    """
    peft = load(NAME, "peft", "peft")
    adapters = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=lora.target_modules,
        fan_in_fan_out=conv1d,
    )
    wrapped: nn.Module = peft.get_peft_model(model, adapters)
    return wrapped


NF4_BLOCK = 64
NF4_SCALER_BLOCK = 256
"""torchao's NF4 defaults (QLoRA's): 64 weights share a scale, 256 scales share their own."""


def _quantize_base(model: nn.Module, kind: str) -> None:
    """Store the frozen base's linear layers, all but the output layer, quantized by torchao.

    `int8`: `quantize_` with `Int8WeightOnlyConfig` (int8 weights, one float scale per row).
    `nf4`: each weight replaced by `to_nf4` of it (4-bit codes, double-quantized block scales);
    torchao's NF4 tensor computes `linear` by dequantizing, and never takes a gradient.
    """
    head = model.get_output_embeddings()  # type: ignore[operator]
    layers = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not head
    ]
    quantization = load(NAME, "qlora", "torchao.quantization")
    if kind == "int8":
        chosen = {id(module) for _, module in layers}
        quantization.quantize_(
            model,
            quantization.Int8WeightOnlyConfig(),
            filter_fn=lambda module, _name: id(module) in chosen,
        )
        for _, module in layers:
            module.__class__ = Int8BaseLinear  # same state, a forward that saves less
        return
    for name, module in layers:
        scaler_block = _nf4_scaler_block(name, module.weight.numel())
        nf4 = quantization.to_nf4(module.weight.detach(), NF4_BLOCK, scaler_block)
        module.weight = nn.Parameter(nf4, requires_grad=False)


class Int8BaseLinear(nn.Linear):
    """A frozen linear layer whose torchao int8 weight is dequantized again in backward.

    torchao's int8 weight-only `linear` multiplies by a float copy of the weight, which autograd
    would save for backward: every layer's float copy alive from its forward to its backward,
    more than a float base holds. As torchao's NF4 `linear` does, this saves the quantized weight
    only and dequantizes it once more for the input's gradient (the weight takes none).
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = _Int8Linear.apply(input, self.weight, self.bias)  # type: ignore[no-untyped-call]
        return output


class _Int8Linear(torch.autograd.Function):
    """torchao's int8 `linear` forward; backward from the saved int8 weight, dequantized."""

    @staticmethod
    def forward(
        ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (weight,) = ctx.saved_tensors
        return grad_output @ weight.dequantize(grad_output.dtype), None, None


def _nf4_scaler_block(layer: str, elements: int) -> int:
    """`NF4_SCALER_BLOCK`, or the largest power of two below it that divides the layer's
    blocks (torchao's NF4 needs whole blocks of both; a grouped-query k_proj may have 128).
    A weight of a number of elements not a multiple of `NF4_BLOCK` is a TaskConfigError."""
    if elements % NF4_BLOCK:
        raise TaskConfigError(
            f"{NAME}: finetune.quantized_base nf4: {layer}'s weight has {elements} elements, "
            f"not a multiple of {NF4_BLOCK} (torchao's NF4 block); choose widths that are, "
            "or int8"
        )
    blocks = elements // NF4_BLOCK
    return math.gcd(blocks, NF4_SCALER_BLOCK)


def _conv1d_as_linear(model: nn.Module) -> None:
    """Replace GPT-2's Conv1D layers (x @ W + b, W stored in x out) by the nn.Linear layers
    they compute (W transposed), so torchao quantizes them and peft adapts them as Linear."""
    conv1d = load(NAME, "hf", "transformers.pytorch_utils").Conv1D
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, conv1d):
                fan_in, fan_out = child.weight.shape
                linear = nn.Linear(fan_in, fan_out, device="meta")
                with torch.no_grad():
                    linear.weight = nn.Parameter(child.weight.t().contiguous())
                linear.bias = child.bias
                setattr(parent, name, linear)


CHUNKED_LOSS = "_vramtune_chunked_loss"
"""The attribute `enable_chunked_loss` sets on a model whose loss is computed in chunks."""


def _chunked_loss(model: nn.Module, codes: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same mean cross-entropy as `loss`, without the B x T x V logits and their gradient.

    The decoder's hidden states go through the output layer a chunk of tokens at a time; each
    chunk's logits are recomputed in backward (non-reentrant checkpointing) instead of kept, so
    one chunk's logits and gradient are alive at a time. As Liger's fused linear cross-entropy
    does, the chunks are as many as the vocabulary is times the width (at least 1): a chunk's
    logits are then about the size of the hidden states.
    """
    unwrap = getattr(model, "get_base_model", None)  # peft's wrapper: its adapters stay in
    causal: Any = model if unwrap is None else unwrap()
    decoder: nn.Module = causal.base_model
    head: nn.Linear = causal.get_output_embeddings()
    with _unpacked_sequences():
        hidden = decoder(input_ids=codes).last_hidden_state
    flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    chunks = max(1, math.ceil(head.out_features / hidden.shape[-1]))
    total = torch.zeros((), device=hidden.device)
    for part, part_targets in zip(flat.chunk(chunks), flat_targets.chunk(chunks), strict=True):
        summed = repeated(_summed_loss)  # every chunk alike: a trace may replay the rest
        total = total + checkpoint(summed, head, part, part_targets, use_reentrant=False)
    return total / flat_targets.numel()


def _summed_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of one chunk of tokens (the mean is taken over all chunks)."""
    return F.cross_entropy(head(hidden), targets, reduction="sum")


def _unpacked_sequences() -> AbstractContextManager[Any]:
    """Tell transformers that no window packs several sequences, for real and fake runs alike.

    Without an attention mask transformers looks for packed sequences in the position ids by
    reading their values, which fake tensors cannot: under the predictor's trace it then builds
    a full 4-D mask and takes another attention kernel than the real run (about 100 KB more on
    a 2-layer Llama at 4 x 32 tokens). Each window here is one sequence, so the answer is "not
    packed" in both runs, and both take SDPA's causal kernel.
    """
    masking_utils = load(NAME, "hf", "transformers.masking_utils")
    return mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda *_: None)
