"""What the server can tell about a built-in model family's study before a worker sees it.

The server never imports torch or the model libraries, so it checks only what the values say:
a Hugging Face model type it knows, attention heads that divide the width, a resolution a
classifier can take. Every choice of every categorical parameter, and every combination of the
parameters a rule relates, is checked with the fixed `task_config` (a 422 naming the field);
what only the worker's libraries know (whether timm has a model of that name) fails the trial
with the worker's reason instead. The worker's tasks run
the same checks on every sampled configuration (worker/tasks/hf.py, worker/tasks/vision.py).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

HF_MODEL_TYPES = ("gpt2", "llama", "qwen2", "mistral")
"""The transformers configs `hf-causal-lm` builds (AutoConfig.for_model names)."""

BYTE_VOCAB = 128
"""The char corpus holds ASCII codes: a vocabulary must hold at least these."""

MIN_RESOLUTION = 16
"""Below this no ImageNet classifier of timm or torchvision runs (most need 32 or more)."""

LORA_OVERRIDES = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "quantized_base")
"""hf-causal-lm's top-level names that override `finetune`'s LoRA settings (so a study can
sample them)."""

QUANTIZED_BASES = ("none", "int8", "nf4")
"""How hf-causal-lm may store a LoRA model's frozen base (`quantized_base`): float, or
quantized by torchao (QLoRA)."""

MODEL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
MAX_COMBINATIONS = 4096

Problem = tuple[str, str]
"""(field, message)."""


def hf_problems(values: Mapping[str, Any]) -> Iterator[Problem]:
    """Why these hf-causal-lm settings cannot be built (fields absent take the task's default)."""
    model_type = values.get("model_type", "llama")
    if model_type not in HF_MODEL_TYPES:
        yield "model_type", f"unknown model type {model_type!r}; use one of {list(HF_MODEL_TYPES)}"
        return
    hidden = values.get("hidden_size", 64)
    heads = values.get("num_attention_heads", 4)
    kv_heads = values.get("num_key_value_heads")
    if _positive(hidden, heads) and hidden % heads:
        yield (
            "num_attention_heads",
            f"hidden_size ({hidden}) must be divisible by num_attention_heads ({heads})",
        )
    elif _positive(hidden, heads) and model_type != "gpt2" and (hidden // heads) % 2:
        yield (
            "num_attention_heads",
            f"{model_type} needs an even head size for rotary embeddings; "
            f"hidden_size {hidden} / num_attention_heads {heads} = {hidden // heads}",
        )
    if kv_heads is not None and model_type == "gpt2" and kv_heads != heads:
        yield "num_key_value_heads", "gpt2 has no grouped-query attention: leave it unset"
    elif _positive(heads, kv_heads) and heads % kv_heads:
        yield (
            "num_key_value_heads",
            f"num_attention_heads ({heads}) must be divisible by num_key_value_heads ({kv_heads})",
        )
    vocab = values.get("vocab_size", BYTE_VOCAB)
    if isinstance(vocab, int) and vocab < BYTE_VOCAB:
        yield "vocab_size", f"must be at least {BYTE_VOCAB} (the corpus is ASCII), got {vocab}"
    yield from _finetune_problems(values)


def _finetune_problems(values: Mapping[str, Any]) -> Iterator[Problem]:
    finetune = values.get("finetune")
    nested = finetune.get("quantized_base") if isinstance(finetune, Mapping) else None
    flat = values.get("quantized_base")
    for field, quantized in (("quantized_base", flat), ("finetune", nested)):
        if quantized is not None and quantized not in QUANTIZED_BASES:
            yield (
                field,
                f"unknown quantized base {quantized!r}; use one of {list(QUANTIZED_BASES)}",
            )
            return
    if finetune is None:
        for name in LORA_OVERRIDES:
            if values.get(name) not in (None, "none"):
                yield name, "needs finetune: {method: lora} in task_config"
                return
        return
    method = finetune.get("method", "lora") if isinstance(finetune, Mapping) else finetune
    if method != "lora":
        yield "finetune", f"unknown method {method!r}: only lora (finetune: lora, or a mapping)"


def image_problems(values: Mapping[str, Any]) -> Iterator[Problem]:
    """Why these timm-image / torchvision-image settings cannot be built, as far as values tell."""
    name = values.get("model_name", "resnet18")
    if not isinstance(name, str) or not MODEL_NAME.match(name):
        yield "model_name", f"not a model name: {name!r}"
    resolution = values.get("resolution", 32)
    if isinstance(resolution, int) and resolution < MIN_RESOLUTION:
        yield "resolution", f"must be at least {MIN_RESOLUTION} pixels, got {resolution}"


RULES: dict[str, Callable[[Mapping[str, Any]], Iterator[Problem]]] = {
    "hf-causal-lm": hf_problems,
    "timm-image": image_problems,
    "torchvision-image": image_problems,
}


def study_problem(
    task: str, task_config: Mapping[str, Any], choices: Mapping[str, list[Any]]
) -> Problem | None:
    """The first problem of any combination of the fixed settings and categorical choices."""
    rule = RULES.get(task)
    if rule is None:
        return None
    for values in _configurations(task, task_config, choices):
        for field, message in rule(values):
            where = "search_space" if field in choices else "task_config"
            return f"{where}.{field}", message
    return None


RELATED: dict[str, tuple[tuple[str, ...], ...]] = {
    "hf-causal-lm": (
        ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads"),
        ("finetune", *LORA_OVERRIDES),
    ),
}
"""The parameters a family's rules read together: only their combinations can clash."""


def _configurations(
    task: str, task_config: Mapping[str, Any], choices: Mapping[str, list[Any]]
) -> Iterator[dict[str, Any]]:
    """Configurations the study can sample, enough that every bad choice is among them.

    The first MAX_COMBINATIONS of the whole product (all of a small space); then every choice
    of every parameter, the others at their first choice; then the combinations of each group
    of parameters the rules relate. A space of 8,704 combinations hid a bad choice past the
    first 4,096 (issue 47); each configuration is one the sampler can draw, so none is refused
    for a combination that cannot happen.
    """
    names = sorted(choices)
    combinations = itertools.product(*(choices[name] for name in names))
    for combination in itertools.islice(combinations, MAX_COMBINATIONS):
        yield {**task_config, **dict(zip(names, combination, strict=True))}
    first = {**task_config, **{name: values[0] for name, values in choices.items() if values}}
    for name in names:
        for choice in choices[name]:
            yield {**first, name: choice}
    for group in RELATED.get(task, ()):
        related = [name for name in names if name in group]
        product = itertools.product(*(choices[name] for name in related))
        for combination in itertools.islice(product, MAX_COMBINATIONS):
            yield {**first, **dict(zip(related, combination, strict=True))}


def _positive(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)
