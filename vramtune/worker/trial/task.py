"""The task interface: what a user writes to make a model tunable by vramtune.

A task turns a configuration into a model, an optimizer, batches, a loss and a metric. The
worker owns the training loop (micro-batching, accumulation, autocast, checkpointing,
measuring), as Lightning's Trainer owns a LightningModule's loop. Tasks are found through the
entry-point group ``vramtune.tasks`` or a worker's ``--tasks module`` option.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn

Config = Mapping[str, Any]
"""A trial's sampled parameters merged over the study's fixed ``task_config``."""

Batch = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Metric:
    """The evaluation metric a task reports: its name and whether higher is better."""

    name: str
    direction: Literal["minimize", "maximize"]


class TaskConfigError(ValueError):
    """The configuration cannot be built (e.g. d_model not divisible by heads).

    The worker reports it as a failed trial with this message; it is never a worker crash.
    """


@runtime_checkable
class Task(Protocol):
    """A tunable training problem.

    Contract:
        name: the name studies use to ask for this task (letters, digits, ``._-``).
        batch_size_param: the configuration key holding the (effective) batch size. The
            worker may split it into micro-batches with gradient accumulation; the task must
            not assume a batch it receives has this size.
        shape_params: configuration keys that change tensor shapes (widths, depth, sequence
            length, resolution...). The predictor caches by these; others (learning rate,
            dropout probability) never change memory.
        metric: what ``evaluate`` returns.

        build_model(config): a fresh ``nn.Module`` on the CPU with the configuration's shapes.
            The predictor calls it under a ``FakeTensorMode`` first; a build that reads tensor
            values or moves parameters (``.item()``, ``torch.unique``, ``Module.to``) is then
            repeated on the ``meta`` device, or for real, and converted (slower, and a real
            build takes host memory). Raise ``TaskConfigError`` for an impossible configuration.
        build_optimizer(model, config): the optimizer over ``model.parameters()``.
        example_batch(config, micro_batch, device): a batch of the right shapes and dtypes built
            only with tensor factories (randn, randint, zeros); used by the predictor under
            fake mode, so no real data and no data-dependent ops.
        batches(config, micro_batch, device, seed): an endless iterator of real training
            batches of ``micro_batch`` examples on ``device``.
        loss(model, batch): the mean loss of the batch (a scalar tensor). The worker scales it
            for accumulation.
        evaluate(model, config, device): the metric on held-out data, with the model in eval
            mode and under ``torch.no_grad()`` (the worker sets both), the plan's micro-batch
            as ``config[batch_size_param]``. The predictor traces it after the training steps
            (worker/predictor/evaluation.py) and the plan fits the larger peak: its memory must
            not depend on the metric's value (a ``.item()`` reads zero in the trace), and a
            data-dependent shape on the model's output leaves it bounded, not traced.
        checkpoint_modules(model): the sub-modules whose forward may be recomputed in the
            backward pass (transformer blocks, conv stages). An empty sequence means the plan
            cannot use activation checkpointing for this task.
        enable_checkpointing(model) (optional): turn on the model's own activation
            checkpointing instead (transformers' ``gradient_checkpointing_enable``, timm's
            ``set_grad_checkpointing``); return False when this model has none. Called as
            ``enable_checkpointing(model, k)`` for selective checkpointing of the first k blocks
            when the task also counts them.
        checkpoint_block_count(config) (optional): how many blocks selective checkpointing
            chooses among (``checkpoint_modules`` or the model's own); without it the
            selective_checkpointing rung is skipped for this task.
        shard_modules(model) (optional): the sub-modules FSDP2 wraps one by one (then the root)
            when a plan spreads the trial over several cards; an empty sequence shards the root
            alone. Without it: a transformers model's ``_no_split_modules`` layers, else
            ``checkpoint_modules``.
        enable_chunked_loss(model) (optional): make ``loss(model, batch)`` compute the same loss
            without the whole batch's output at once (hf-causal-lm's chunked cross-entropy);
            return whether it can. Without it the chunked_cross_entropy rung is skipped.
    """

    name: str
    batch_size_param: str
    shape_params: frozenset[str]
    metric: Metric

    def build_model(self, config: Config) -> nn.Module: ...

    def build_optimizer(self, model: nn.Module, config: Config) -> torch.optim.Optimizer: ...

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch: ...

    def batches(
        self, config: Config, micro_batch: int, device: torch.device, seed: int
    ) -> Iterator[Batch]: ...

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor: ...

    def evaluate(self, model: nn.Module, config: Config, device: torch.device) -> float: ...

    def checkpoint_modules(self, model: nn.Module) -> Sequence[nn.Module]: ...
