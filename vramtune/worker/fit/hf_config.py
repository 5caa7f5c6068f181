"""A local Hugging Face ``config.json`` as a task `fit` can trace: ``vramtune fit hf:PATH``.

The model is built as a user builds one to train from scratch:
``AutoConfig.from_pretrained(<the local file or folder>)`` then the ``AutoModelFor...`` class
its ``architectures`` names, ``from_config`` (random weights, float32). Nothing is downloaded:
the path must exist and transformers is told to stay local. The example batch is random token
ids of ``batch_size`` × ``seq_len`` with the labels the head takes, so the loss is the model's
own (``model(**batch).loss``), as a Trainer computes it.

The task is a `ModuleTask`, so everything `fit` does for a module (plans, the largest
micro-batch, ranks) it does here too.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vramtune.worker.fit.adapter import BATCH_SIZE, ModuleTask, OptimizerSource
from vramtune.worker.trial.task import Batch

PREFIX = "hf:"
SEQ_LEN = "seq_len"
KEYS = frozenset({BATCH_SIZE, SEQ_LEN})
"""The configuration an ``hf:`` model reads: its batch and its sequence length."""

HEADS: tuple[tuple[str, str], ...] = (
    ("ForCausalLM", "AutoModelForCausalLM"),
    ("LMHeadModel", "AutoModelForCausalLM"),
    ("ForMaskedLM", "AutoModelForMaskedLM"),
    ("ForSequenceClassification", "AutoModelForSequenceClassification"),
    ("ForTokenClassification", "AutoModelForTokenClassification"),
    ("ForQuestionAnswering", "AutoModelForQuestionAnswering"),
    ("ForConditionalGeneration", "AutoModelForSeq2SeqLM"),
    ("Model", "AutoModel"),  # a bare model ("BertModel"): no head, no loss of its own
)
"""The ``architectures`` suffix → the Auto class whose head it is (first match wins)."""

FALLBACKS = ("AutoModelForCausalLM", "AutoModel")
"""Tried in turn when the config names no head, or one its family does not have."""


class HFConfigError(ValueError):
    """A config that cannot be read or built; the caller names its argument."""


def is_hf_source(model: object) -> bool:
    """``"hf:PATH"`` or a transformers ``PretrainedConfig`` (checked by name: no import;
    transformers 5 spells the class ``PreTrainedConfig``)."""
    if isinstance(model, str):
        return model.startswith(PREFIX)
    names = {"PretrainedConfig", "PreTrainedConfig"}
    return any(cls.__name__ in names for cls in type(model).__mro__)


def read_config(source: object) -> Any:
    """The ``PretrainedConfig`` for ``hf:PATH`` (a config.json or the folder holding it), or
    the config given; HFConfigError says what is wrong with the path."""
    if not isinstance(source, str):
        return source
    path = Path(source.removeprefix(PREFIX)).expanduser()
    if not str(path) or str(path) == ".":
        raise HFConfigError("give a config file after hf:, e.g. hf:./llama/config.json")
    if not (path / "config.json" if path.is_dir() else path).is_file():
        raise HFConfigError(f"no Hugging Face config at {path} (a config.json or its folder)")
    transformers = _transformers()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local file: never ask the Hub
    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
        raise HFConfigError(f"{path} is not a config transformers can read: {error}") from error


def hf_task(
    source: object, seq_len: int, optimizer: OptimizerSource = "adamw", lora: Any = None
) -> ModuleTask:
    """A `ModuleTask` of the config's model, token-id batches of `seq_len` and its own loss;
    with `lora` (`vramtune.worker.tasks.hf.LoRASettings`) in the adapters hf-causal-lm trains
    (the base frozen, quantized for QLoRA): a causal LM only, as that task's adapters are."""
    config = read_config(source)
    config.use_cache = False  # a training step keeps no key/value cache
    auto_class = _auto_class(config)
    if lora is not None and auto_class != "AutoModelForCausalLM":
        raise ValueError(f"lora: adapters go on a causal LM here, not an {auto_class} model")
    names, batch = _example_batch(config, auto_class, seq_len)
    # Each example is one sequence: say so, or the trace (which cannot read position ids to
    # look for packed ones) builds a 4-D mask the real run does not (hf-causal-lm's reason).
    from vramtune.worker.tasks.hf import _unpacked_sequences

    def build() -> nn.Module:
        model: nn.Module = _transformers_attr(auto_class).from_config(config, dtype=torch.float32)
        if lora is None:
            return model
        from vramtune.worker.tasks.hf import with_finetune

        conv1d = any(type(module).__name__ == "Conv1D" for module in model.modules())
        return with_finetune(model, lora, conv1d)

    def own_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        with _unpacked_sequences():
            out = model(**dict(zip(names, batch, strict=True)))
        loss = getattr(out, "loss", None)
        # A bare encoder (AutoModel) has no loss: its output's mean stands for one.
        return loss if isinstance(loss, torch.Tensor) else out[0].float().mean()

    name = str((getattr(config, "architectures", None) or [config.model_type])[0])
    if lora is not None:
        base = "" if lora.quantized_base == "none" else f", {lora.quantized_base} base"
        name += f" + LoRA r={lora.r}{base}"
    return ModuleTask(build, batch, optimizer, loss=own_loss, name=name)


def _auto_class(config: Any) -> str:
    """The Auto class of the config's first architecture, else the first fallback that takes
    the config's family."""
    wanted = [
        auto
        for arch in getattr(config, "architectures", None) or []
        for suffix, auto in HEADS
        if arch.endswith(suffix)
    ]
    for auto in (*wanted[:1], *FALLBACKS):
        mapping = getattr(_transformers_attr(auto), "_model_mapping", None)
        if mapping is None or type(config) in mapping:
            return auto
    raise HFConfigError(f"transformers has no model for a {config.model_type!r} config")


def _example_batch(
    config: Any, auto_class: str, seq_len: int
) -> tuple[tuple[str, ...], Callable[[int], tuple[torch.Tensor, ...]]]:
    """The keyword names of the batch and a builder ``(n) -> batch`` (factories only: the
    trace calls it under fake tensors)."""
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 1:
        raise HFConfigError("the config has no vocab_size: token ids cannot be made for it")
    labels = int(getattr(config, "num_labels", 2) or 2)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, vocab, (n, seq_len))

    if auto_class == "AutoModelForSequenceClassification":
        return ("input_ids", "labels"), lambda n: (tokens(n), torch.randint(0, labels, (n,)))
    if auto_class == "AutoModelForTokenClassification":
        return ("input_ids", "labels"), lambda n: (
            tokens(n),
            torch.randint(0, labels, (n, seq_len)),
        )
    if auto_class == "AutoModelForQuestionAnswering":
        positions = ("input_ids", "start_positions", "end_positions")
        return positions, lambda n: (
            tokens(n),
            torch.randint(0, seq_len, (n,)),
            torch.randint(0, seq_len, (n,)),
        )
    if auto_class == "AutoModel":
        return ("input_ids",), lambda n: (tokens(n),)
    return ("input_ids", "labels"), lambda n: (tokens(n), tokens(n))


def _transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError as error:
        raise HFConfigError("hf: configs need transformers: pip install 'vramtune[hf]'") from error


def _transformers_attr(name: str) -> Any:
    return getattr(_transformers(), name)
