"""The smaller plain-PyTorch contract: write what memory depends on, inherit the rest.

A `PlainTask` subclass declares its ``name`` and ``shape_params`` and writes four methods:
``build_model``, ``build_optimizer``, ``data`` (the training examples as tensors) and ``loss``.
Everything else of the full `vramtune.worker.trial.task.Task` protocol has a default that keeps its
rules:

- ``batches``: seeded, shuffled micro-batches of ``data`` (`worker.trial.data.seeded_batches`,
  which keeps no tensor but the batch alive, so the trace stays exact). Override it to stream
  data that does not fit in memory, keeping that rule.
- ``example_batch``: zeros of the shapes and dtypes of a real batch of the same size. The real
  batch is drawn with every dispatch mode suspended (the predictor calls this inside its
  FakeTensorMode and memory tracker), so the data's values never reach the trace and its bytes
  are never counted.
- ``evaluate``: the mean loss over ``eval_batches`` held-out batches of ``eval_batch_size``
  examples of ``held_out_data`` (by default the training data). Chunked
  evaluation is the default because an evaluation that runs the whole held-out set at once can
  peak far above the training step the plan was sized to (issue 29).
- ``metric``: ``Metric("loss", "minimize")``; ``batch_size_param``: ``"batch_size"``;
  ``checkpoint_modules``: none (override it to let plans recompute activations).

Override any of them, as a full Task would write it, when the default does not fit.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from vramtune.worker.trial.data import seeded_batches
from vramtune.worker.trial.task import Batch, Config, Metric


class PlainTask:
    """Subclass, declare ``name`` and ``shape_params``, write ``build_model``,
    ``build_optimizer``, ``data`` and ``loss``; `vramtune tasks check FILE` says what is
    missing."""

    name: str
    shape_params: frozenset[str]
    batch_size_param = "batch_size"
    metric = Metric("loss", "minimize")
    eval_batches = 8
    """How many held-out batches the default evaluate averages the loss over."""
    eval_batch_size = 32
    """Examples per held-out batch, capped at the trial's batch size (without gradients, a
    batch's forward pass holds less than its training step)."""

    def build_model(self, config: Config) -> nn.Module:
        """A fresh model on the CPU with the configuration's shapes."""
        raise NotImplementedError(f"{type(self).__name__}: write build_model(config)")

    def build_optimizer(self, model: nn.Module, config: Config) -> torch.optim.Optimizer:
        """The optimizer over ``model.parameters()``."""
        raise NotImplementedError(f"{type(self).__name__}: write build_optimizer(model, config)")

    def data(self, config: Config) -> tuple[torch.Tensor, ...]:
        """The training examples: tensors on the CPU whose first dimension counts examples."""
        raise NotImplementedError(f"{type(self).__name__}: write data(config)")

    def held_out_data(self, config: Config) -> tuple[torch.Tensor, ...]:
        """The held-out examples the default evaluate scores: the training data unless
        overridden."""
        return self.data(config)

    def batches(
        self, config: Config, micro_batch: int, device: torch.device, seed: int
    ) -> Iterator[Batch]:
        """Endless seeded micro-batches of ``data`` on ``device``."""
        return _batches_of(self._examples(self.data, config), micro_batch, device, seed)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The batch's mean loss, a scalar tensor."""
        raise NotImplementedError(f"{type(self).__name__}: write loss(model, batch)")

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        """Zeros shaped as a real batch of ``micro_batch`` examples (made with factories only)."""
        with _disable_current_modes():  # the real batch stays out of the trace and its count
            real = next(iter(self.batches(config, micro_batch, torch.device("cpu"), seed=0)))
            layout = [(tuple(t.shape), t.dtype) for t in real]
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in layout)

    def evaluate(self, model: nn.Module, config: Config, device: torch.device) -> float:
        """The mean loss over up to ``eval_batches`` held-out batches of ``eval_batch_size``
        examples, or of the trial's batch size when smaller."""
        size = min(self.eval_batch_size, int(config[self.batch_size_param]))
        examples = self._examples(self.held_out_data, config)
        stream = _batches_of(examples, size, device, seed=0)
        losses = [
            float(self.loss(model, b).detach()) for b in itertools.islice(stream, self.eval_batches)
        ]
        return sum(losses) / len(losses)

    def _examples(
        self, source: Callable[[Config], tuple[torch.Tensor, ...]], config: Config
    ) -> tuple[torch.Tensor, ...]:
        """`source(config)`, made with every dispatch mode suspended and kept for the next call
        with the same configuration: a data set is loaded before a run, not memory the run
        allocates (the worker's tracker would count a copy made inside it; the trace has none)."""
        key = (source.__name__, tuple(sorted(config.items())))
        cached = self._loaded.get(source.__name__)
        if cached is None or cached[0] != key:
            with _disable_current_modes():
                cached = self._loaded[source.__name__] = (key, source(config))
        return cached[1]

    @functools.cached_property
    def _loaded(self) -> dict[str, tuple[object, tuple[torch.Tensor, ...]]]:
        """The last data loaded per source (one configuration each: trials differ in lr)."""
        return {}

    def checkpoint_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        """None by default: plans then resize without activation checkpointing."""
        return []

    # The marker `worker.trial.rungs.task_can_checkpoint` reads: a subclass that does not
    # override this default has no checkpointing rung (never planned, advised or claimed).
    checkpoint_modules.marks_no_modules = True  # type: ignore[attr-defined]


def _batches_of(
    examples: tuple[torch.Tensor, ...], micro_batch: int, device: torch.device, seed: int
) -> Iterator[Batch]:
    """Seeded micro-batches of in-memory examples, moved to `device` batch by batch."""
    return seeded_batches(
        len(examples[0]),
        micro_batch,
        seed,
        lambda picked: tuple(tensor[picked].to(device) for tensor in examples),
    )
