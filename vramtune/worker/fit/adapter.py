"""A plain `nn.Module` (or a builder), an example batch and an optimizer as a vramtune task.

`ModuleTask` is the one adapter between what a user has in a notebook and the predictor: it is
a `PlainTask` in all but its data (an example batch, or a builder of one, stands for the data
set), so `vramtune.worker.predictor.predict` traces it as it traces any task, and the plan
ladder resizes it. Given the user's own ``step(model, batch, optimizer)`` it carries it as
``own_step``, which the trace runs as written instead of the worker's step
(`vramtune.worker.predictor.trace`).
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from vramtune.worker.integrations.plain import PlainTask
from vramtune.worker.predictor.trace import OwnStep
from vramtune.worker.trial.task import Batch, Config, TaskConfigError

BATCH_SIZE = "batch_size"
_ADAPTERS = itertools.count()
DEFAULT_LR = 1e-3

ModelSource = nn.Module | Callable[[], nn.Module]
BatchSource = torch.Tensor | Sequence[torch.Tensor] | Callable[[int], Any]
OptimizerSource = str | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFunction = Callable[[nn.Module, Batch], torch.Tensor]

OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=DEFAULT_LR),
    "adam": lambda params: torch.optim.Adam(params, lr=DEFAULT_LR),
    "sgd": lambda params: torch.optim.SGD(params, lr=DEFAULT_LR),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=DEFAULT_LR, momentum=0.9),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=DEFAULT_LR),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=DEFAULT_LR),
    "adafactor": lambda params: torch.optim.Adafactor(params, lr=DEFAULT_LR),
}
"""Optimizers by name, at torch's defaults but the learning rate (which memory ignores)."""


def optimizer_factory(
    optimizer: OptimizerSource,
) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """The factory for a name of `OPTIMIZERS` or a callable taking the parameters."""
    if callable(optimizer):
        return optimizer
    factory = OPTIMIZERS.get(str(optimizer).lower().replace("_", "-"))
    if factory is None:
        raise ValueError(
            f"optimizer: unknown name {optimizer!r}; use one of {', '.join(OPTIMIZERS)} "
            "or a callable taking the parameters"
        )
    return factory


def default_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The model's output on the batch as a loss: its ``.loss`` (Hugging Face models given
    labels), a scalar output as it is, else the mean of a floating output (what backward
    needs; a task's real loss may hold a little more, pass ``loss=`` for it)."""
    out = model(*batch)
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, tuple | list):
        out = out[0]
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise TaskConfigError(
            "loss: the model's output is not a floating tensor; pass loss=fn(model, batch)"
        )
    return out if out.dim() == 0 else out.mean()


class ModuleTask(PlainTask):
    """A model, a batch and an optimizer as a task whose configuration is its batch size.

    Args:
        model: an ``nn.Module`` (copied for each build: the trace makes its tensors fake, a
            real run trains a copy) or a builder ``() -> nn.Module``.
        batch: an example batch (a tensor or a tuple of tensors whose first dimension counts
            examples) or a builder ``(n) -> batch`` of n examples, made with tensor factories.
        optimizer: a name of `OPTIMIZERS` or ``(parameters) -> Optimizer``.
        step: the user's own ``step(model, batch, optimizer)``, traced as written; None runs
            vramtune's step (forward, ``loss`` backward, ``optimizer.step()``), which plans
            can resize.
        loss: ``loss(model, batch)`` for vramtune's step (default `default_loss`).
        name: the task's name in results.
    """

    shape_params = frozenset({BATCH_SIZE})
    batch_size_param = BATCH_SIZE

    def __init__(
        self,
        model: ModelSource,
        batch: BatchSource,
        optimizer: OptimizerSource = "adamw",
        *,
        step: OwnStep | None = None,
        loss: LossFunction | None = None,
        name: str | None = None,
    ) -> None:
        self._model = model
        self._batch = batch
        self._optimizer = optimizer_factory(optimizer)
        self._loss = loss or default_loss
        if step is not None:
            self.own_step = step
        self.name = name or _name_of(model)
        # The predictor caches by task name and configuration, which a module in hand does not
        # describe (Net(64), then Net(4096), in one notebook): each adapter is a model of its own.
        self.cache_token = next(_ADAPTERS)

    def example_size(self) -> int | None:
        """The example batch's size (its first dimension); None for a builder."""
        if callable(self._batch) and not isinstance(self._batch, torch.Tensor):
            return None
        return int(_tensors(self._batch)[0].shape[0])

    def build_model(self, config: Config) -> nn.Module:
        """A fresh model: the builder's, or a copy of the user's module (see `_copy`)."""
        if isinstance(self._model, nn.Module):
            return _copy(self._model)
        return self._model()

    def build_optimizer(self, model: nn.Module, config: Config) -> torch.optim.Optimizer:
        """The optimizer over the trainable parameters (a frozen one has no state)."""
        return self._optimizer([p for p in model.parameters() if p.requires_grad])

    def data(self, config: Config) -> tuple[torch.Tensor, ...]:
        """The example batch as a data set (repeated up to the batch size)."""
        size = int(config[BATCH_SIZE])
        if callable(self._batch) and not isinstance(self._batch, torch.Tensor):
            return _tensors(self._batch(size))
        tensors = _tensors(self._batch)
        picked = torch.arange(size) % tensors[0].shape[0]
        return tuple(t[picked] for t in tensors)

    def example_batch(self, config: Config, micro_batch: int, device: torch.device) -> Batch:
        """The builder's batch of `micro_batch` examples (on `device`), else zeros shaped as
        the example's rows: factories only, as the trace needs."""
        if callable(self._batch) and not isinstance(self._batch, torch.Tensor):
            with torch.device(device):
                return _tensors(self._batch(micro_batch))
        return tuple(
            torch.zeros((micro_batch, *t.shape[1:]), dtype=t.dtype, device=device)
            for t in _tensors(self._batch)
        )

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The loss vramtune's step takes the backward of."""
        return self._loss(model, batch)

    def evaluate(self, model: nn.Module, config: Config, device: torch.device) -> float:
        """Nothing: a model given alone has no evaluation (the result says so)."""
        return 0.0

    def checkpoint_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        """The model's repeated blocks, the children of its largest ``nn.ModuleList`` or
        ``nn.Sequential`` of at least two modules: what the checkpointing rung recomputes."""
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList | nn.Sequential)]
        blocks = max(lists, key=len, default=None)
        return list(blocks) if blocks is not None and len(blocks) >= 2 else []


def _copy(model: nn.Module) -> nn.Module:
    """A copy of `model` made as the active modes make tensors.

    Under the trace's FakeTensorMode each parameter and buffer becomes a fresh tensor made by a
    factory (counted by the trace's tracker as a build would be; the user's real values cannot
    enter a fake mode, and the user's module is never modified); tied parameters stay tied
    (one copy per object). Outside a fake mode it is a plain deep copy, values included (a
    real run's tracker counts it as made there).
    """
    if not any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack()):
        return copy.deepcopy(model)
    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in memo:
            continue
        made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
        if isinstance(tensor, nn.Parameter):
            made = nn.Parameter(made, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = made
    return copy.deepcopy(model, memo)


def _tensors(batch: Any) -> tuple[torch.Tensor, ...]:
    """A batch as the tuple of tensors a task's batch is."""
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if isinstance(batch, Sequence) and batch and all(isinstance(t, torch.Tensor) for t in batch):
        return tuple(batch)
    raise TaskConfigError("batch: give a tensor, a tuple of tensors, or a builder (n) -> batch")


def _name_of(model: ModelSource) -> str:
    """A readable name: the module's class (or the class given as the builder), or the
    builder function's name."""
    if isinstance(model, nn.Module):
        return type(model).__name__
    if inspect.isclass(model):
        return model.__name__
    name = getattr(model, "__name__", "") if inspect.isfunction(model) else ""
    return name if name and name != "<lambda>" else "model"


def iter_batches(task: ModuleTask, config: Config) -> Iterator[Batch]:
    """Real batches of the configuration's size, endlessly (tests, a real run)."""
    return task.batches(config, int(config[BATCH_SIZE]), torch.device("cpu"), seed=0)
