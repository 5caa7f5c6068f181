"""A user's `LightningModule` and `LightningDataModule`, as they are, tuned by vramtune.

`LightningTask` is a `TrialRunner` (``pip install 'vramtune[lightning]'``). The user gives
two factories, one for the module and one for the data module (called with the plan's
micro-batch in place of the batch size), the metric their `validation_step` logs, and which
configuration keys change shapes; nothing in their classes changes.

- **Predicting**: the module is built under `FakeTensorMode` and two optimizer steps run
  through its own `training_step` and `configure_optimizers` in the order Lightning's
  automatic optimization runs them (`lightning_step`): the next batch already prefetched,
  `training_step` under the precision's autocast, the loss divided by the accumulation and
  its detached copy kept, `optimizer_zero_grad` *after* the first micro-batch's forward (the
  last step's gradients are alive through it), `backward`, then the optimizer step. The
  batches are tensors of the data module's own first batch's shapes and dtypes.
- **Resizing**: a plan's micro-batch and accumulation become the data module's batch size and
  the Trainer's ``accumulate_grad_batches`` (only micro-batches that divide the batch: Lightning
  accumulates whole batches), bf16 becomes ``precision="bf16-mixed"``, checkpointing wraps
  the modules `checkpoint_modules` names.
- **Predicting the validation**: after the two steps, `validation_step` runs over validation
  batches of the val loader's first batch's shapes as `fit` runs it between steps
  (`validation_loop`), in the tracker's evaluation phase (`vramtune.worker.predictor.evaluation`); a
  validation that cannot be traced is bounded by the training step's peak, and the
  prediction's reason says so.
- **Running**: a real `lightning.Trainer.fit` inside the worker's peak meter; a callback in
  the manner of Optuna's ``PyTorchLightningPruningCallback`` reports the monitored metric
  after each validation and stops the run when the study's pruner prunes it; each validation
  runs in the meter's evaluation window (`on_validation_start` to `on_validation_end`), so
  the training and validation peaks are measured apart.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map_only

from vramtune.service.wire import Plan, Prediction, TrainBudget
from vramtune.worker.device.memory import MemoryLimitExceeded, MemoryTracker, round_up
from vramtune.worker.predictor.core import (
    allocator_capacity,
    card_constants,
    divisors,
    from_trace,
    largest_fitting_divisor,
)
from vramtune.worker.predictor.emulation import cuda_emulation, prefer_foreach
from vramtune.worker.predictor.opmodel import real_kernel_storages
from vramtune.worker.predictor.trace import (
    CannotTrace,
    Target,
    Trace,
    _FakeDeepcopy,
    correct_fake,
    evaluation_part,
    target_for,
    untraceable_reason,
)
from vramtune.worker.run.training import PeakMeter, meter_for, release_device_memory
from vramtune.worker.trial.runner import (
    CardSpec,
    Config,
    OutOfMemory,
    Reporter,
    RunResult,
    Stopped,
)
from vramtune.worker.trial.steps import autocast_for, checkpoint_forward
from vramtune.worker.trial.task import Metric, TaskConfigError

try:
    import lightning as L
    from lightning.fabric.utilities.data import sized_len
    from lightning.pytorch.core.optimizer import _configure_optimizers, _MockOptimizer
except ImportError as error:  # the task is then not advertised: discovery records this reason
    raise ImportError(
        f"the Lightning integration needs lightning: pip install 'vramtune[lightning]' ({error})"
    ) from error

TRACED_STEPS = 2
ModuleFactory = Callable[[Config], "L.LightningModule"]
DataModuleFactory = Callable[[Config], "L.LightningDataModule"]
# The hooks a module must define itself for automatic optimization (LightningModule's own
# versions only raise or warn).
REQUIRED_MEMBERS = ("training_step", "configure_optimizers")


@dataclass(eq=False)
class LightningTask:
    """A Lightning module and data module as a vramtune task (a `TrialRunner`).

    Args:
        name: the task name studies use.
        module: builds the `LightningModule` from a trial's configuration.
        datamodule: builds the `LightningDataModule` from a trial's configuration; the value
            under `batch_size_param` is the plan's micro-batch, not the effective batch.
        monitor: the metric `validation_step` logs (``self.log(monitor, ...)``).
        direction: whether `monitor` is maximized or minimized.
        batch_size_param: the configuration key of the effective batch size.
        shape_params: configuration keys that change tensor shapes (predictions are cached by
            them).
        checkpoint_modules: the module's sub-modules that may be recomputed in backward; None
            means plans never use activation checkpointing.
        trainer_options: further `lightning.Trainer` arguments (gradient_clip_val...).
    """

    name: str
    module: ModuleFactory
    datamodule: DataModuleFactory
    monitor: str
    direction: Literal["minimize", "maximize"] = "maximize"
    batch_size_param: str = "batch_size"
    shape_params: frozenset[str] = frozenset()
    checkpoint_modules: Callable[[nn.Module], Sequence[nn.Module]] | None = None
    trainer_options: Mapping[str, Any] = field(default_factory=dict)
    can_bf16: bool = True
    _predictions: dict[Hashable, Prediction] = field(default_factory=dict, repr=False)
    _sample_batches: dict[Hashable, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for member in ("module", "datamodule"):
            if not callable(getattr(self, member)):
                raise TypeError(f"LightningTask {self.name!r}: {member} must be callable")
        if self.direction not in ("minimize", "maximize"):
            raise ValueError(f"LightningTask {self.name!r}: direction must be minimize or maximize")
        self.shape_params = frozenset(self.shape_params)

    # ---------------------------------------------------------------- TrialRunner

    @property
    def task_name(self) -> str:
        """The name the worker advertises."""
        return self.name

    @property
    def metric(self) -> Metric:
        """The monitored metric (what `vramtune tasks` lists)."""
        return Metric(self.monitor, self.direction)

    @property
    def can_checkpoint(self) -> bool:
        """Plans may checkpoint only the modules the user named."""
        return self.checkpoint_modules is not None

    def batch_size(self, config: Config) -> int:
        """The effective batch size: the configuration's `batch_size_param`."""
        if self.batch_size_param not in config:
            raise TaskConfigError(f"{self.name}: {self.batch_size_param}: missing from the config")
        value = config[self.batch_size_param]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TaskConfigError(
                f"{self.name}: {self.batch_size_param}: must be an integer >= 1, got {value!r}"
            )
        return value

    def predict(self, config: Config, plan: Plan, card: CardSpec) -> Prediction:
        """The traced peak of two Lightning optimizer steps under `plan` on `card`."""
        started = time.perf_counter()
        target = target_for(card)
        constants = card_constants(card) if target.cuda else card_constants(None)
        capacity = allocator_capacity(card, target)
        key = (
            self._shape_key(config),
            self._plan_key(config, plan),
            target,
            str(constants),
            capacity,
        )
        if key not in self._predictions:
            try:
                trace = trace_lightning(self, config, plan, target)
            except CannotTrace as error:
                return Prediction(
                    peak_allocated_bytes=0,
                    peak_reserved_bytes=0,
                    method="none",
                    reason=f"cannot trace: {error.reason}"[:4096],
                    seconds=time.perf_counter() - started,
                )
            self._predictions[key] = from_trace(trace, target, constants, 0.0, capacity=capacity)
        return self._predictions[key].model_copy(update={"seconds": time.perf_counter() - started})

    def largest_micro_batch(
        self, config: Config, plan: Plan, budget_bytes: int, card: CardSpec
    ) -> tuple[int, Prediction] | None:
        """The largest micro-batch dividing the batch whose traced footprint fits (bisected:
        the peak grows with the micro-batch)."""
        return largest_fitting_divisor(
            self.batch_size(config),
            plan,
            budget_bytes,
            lambda planned: self.predict(config, planned, card),
        )

    def run(
        self, config: Config, plan: Plan, budget: TrainBudget, card: CardSpec, reporter: Reporter
    ) -> RunResult:
        """`lightning.Trainer.fit` under `plan` within `budget`, measured by the worker's meter."""
        batch = self.batch_size(config)
        micro, accumulation = lightning_micro_batch(batch, plan)
        device = torch.device(card.device)
        datamodule = self.build_datamodule(config, micro)
        meter = meter_for(card)
        started = time.monotonic()
        callback = _ReportingCallback(self.monitor, reporter, meter)
        try:
            with meter:
                torch.manual_seed(int(config.get("seed", 0)))
                module = self.build_module(config, plan)
                trainer = self._trainer(plan, budget, device, accumulation, callback)
                trainer.fit(module, datamodule=datamodule)
                value = callback.final_value(trainer, module, datamodule)
        except meter.out_of_memory as error:
            message = f"out of memory: {error}"
        else:
            return RunResult(
                values=[value],
                measured=meter.measured(),
                duration_s=time.monotonic() - started,
                samples_per_s=trainer.global_step * batch / max(callback.train_seconds(), 1e-9),
                steps=trainer.global_step,
            )
        release_device_memory(device)
        raise OutOfMemory(message, meter.measured())

    # ---------------------------------------------------------------- building

    def build_module(self, config: Config, plan: Plan) -> L.LightningModule:
        """The user's module, checked for what automatic optimization needs, with the plan's
        checkpointing applied."""
        module = self.module(config)
        check_module(self.name, module)
        if plan.checkpointing:
            wrapped = list(self.checkpoint_modules(module)) if self.checkpoint_modules else []
            if not wrapped:
                raise TaskConfigError(f"{self.name}: checkpoint_modules names no modules")
            for block in wrapped:
                checkpoint_forward(block)
        return module

    def build_datamodule(self, config: Config, micro_batch: int) -> L.LightningDataModule:
        """The user's data module for batches of `micro_batch` examples."""
        datamodule = self.datamodule({**config, self.batch_size_param: micro_batch})
        if not isinstance(datamodule, L.LightningDataModule):
            raise TaskConfigError(
                f"{self.name}: datamodule returned {type(datamodule).__qualname__}, "
                "not a LightningDataModule"
            )
        if type(datamodule).train_dataloader is L.LightningDataModule.train_dataloader:
            raise TaskConfigError(
                f"{self.name}: {type(datamodule).__qualname__} does not define train_dataloader"
            )
        # What these make at call time (a dataset, a list of examples) is host data; the
        # batches a loader yields while training are counted.
        for hook in ("prepare_data", "setup", "train_dataloader", "val_dataloader"):
            setattr(datamodule, hook, _uncounted(getattr(datamodule, hook)))
        return datamodule

    def sample_batch(self, config: Config, micro_batch: int) -> Samples:
        """The data module's first training and validation batches (real tensors, read once
        per shape), and whether Lightning prefetches from its loader (one without a length)."""
        key = (self._shape_key(config), micro_batch)
        if key not in self._sample_batches:
            datamodule = self.build_datamodule(config, micro_batch)
            datamodule.prepare_data()
            datamodule.setup("fit")
            loader = datamodule.train_dataloader()
            validation = None
            if type(datamodule).val_dataloader is not L.LightningDataModule.val_dataloader:
                validation = next(iter(datamodule.val_dataloader()))
            first, residue = first_batch_and_residue(loader)
            length = sized_len(loader)
            self._sample_batches[key] = Samples(first, length is None, validation, residue, length)
        found: Samples = self._sample_batches[key]
        return found

    def _trainer(
        self,
        plan: Plan,
        budget: TrainBudget,
        device: torch.device,
        accumulation: int,
        callback: _ReportingCallback,
    ) -> L.Trainer:
        """A Trainer that runs the plan: accumulation, precision, validation every
        `budget.eval_every` optimizer steps, no logger, checkpoint files or progress bar."""
        options: dict[str, Any] = {
            "accelerator": "gpu" if device.type == "cuda" else "cpu",
            "devices": [device.index or 0] if device.type == "cuda" else 1,
            "max_steps": budget.max_steps if budget.max_steps is not None else -1,
            "max_epochs": -1,
            "accumulate_grad_batches": accumulation,
            "precision": "bf16-mixed" if plan.bf16 else "32-true",
            # Lightning counts validation intervals in training batches, not optimizer steps.
            "val_check_interval": budget.eval_every * accumulation,
            "check_val_every_n_epoch": None,
            "num_sanity_val_steps": 0,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "callbacks": [callback],
            **self.trainer_options,
        }
        if budget.max_seconds is not None:
            options["max_time"] = timedelta(seconds=budget.max_seconds)
        return L.Trainer(**options)

    def _shape_key(self, config: Config) -> tuple[Hashable, ...]:
        return tuple((name, repr(config.get(name))) for name in sorted(self.shape_params))

    def _plan_key(self, config: Config, plan: Plan) -> tuple[Hashable, ...]:
        micro, accumulation = lightning_micro_batch(self.batch_size(config), plan)
        return (micro, accumulation, plan.checkpointing, plan.bf16)


@dataclass(frozen=True)
class Samples:
    """A data module's first batches, whose shapes and dtypes the trace's batches take."""

    train: Any
    prefetch: bool
    validation: Any | None
    residue_bytes: int = 0
    """What the loader's iterator keeps alive besides the batch it yields (an iterable
    dataset's generator holds its last example), measured on the real loader."""
    length: int | None = None
    """The training loader's batches per epoch (None without a length)."""

    def validates_between_steps(self, accumulation: int) -> bool:
        """Whether every validation starts at an optimizer step's boundary, where Lightning
        releases the gradients first. Lightning counts validation intervals in loader batches
        and steps on a partial accumulation at an epoch's end: when an epoch's batches are not
        a multiple of the accumulation, a later validation falls inside an accumulation
        window, beside its gradients."""
        return accumulation == 1 or (self.length is not None and self.length % accumulation == 0)


def first_batch_and_residue(loader: Any) -> tuple[Any, int]:
    """The loader's first batch, and the bytes its iterator holds besides that batch."""
    tracker = MemoryTracker(device_type="cpu")
    with tracker:
        iterator = iter(loader)
        batch = next(iterator)
    storages = {
        id(leaf.untyped_storage()): leaf.untyped_storage().nbytes()
        for leaf in tree_leaves(batch)
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu"
    }
    own = sum(round_up(nbytes, tracker.round_to) for nbytes in storages.values())
    residue = max(tracker.live_bytes - own, 0)
    del iterator
    return batch, residue


def _uncounted(hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook` run outside the peak meter's dispatch mode: the data a data module loads stays on
    the host (on a GPU card it is not card memory), as the built-in tasks load theirs before the
    measured window; on the simulated CPU card it would otherwise count as the card's."""

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return hook(*args, **kwargs)

    return run


def lightning_micro_batch(batch_size: int, plan: Plan) -> tuple[int, int]:
    """(micro-batch, accumulate_grad_batches) for `plan`: the largest divisor of the batch at
    most the plan's micro-batch, since Lightning accumulates whole loader batches."""
    wanted = min(plan.micro_batch or batch_size, batch_size)
    micro = max(d for d in divisors(batch_size) if d <= wanted)
    return micro, batch_size // micro


def check_module(task: str, module: object) -> None:
    """Raise TaskConfigError naming what a module lacks for automatic optimization."""
    if not isinstance(module, L.LightningModule):
        raise TaskConfigError(
            f"{task}: module returned {type(module).__qualname__}, not a LightningModule"
        )
    cls = type(module)
    for member in REQUIRED_MEMBERS:
        if getattr(cls, member) is getattr(L.LightningModule, member):
            raise TaskConfigError(f"{task}: {cls.__qualname__} does not define {member}")
    if not module.automatic_optimization:
        raise TaskConfigError(
            f"{task}: {cls.__qualname__}.automatic_optimization is False; only automatic "
            "optimization can be resized"
        )


def optimizer_of(task: str, module: L.LightningModule) -> torch.optim.Optimizer:
    """The one optimizer `configure_optimizers` returns, parsed as Lightning parses it."""
    returned: Any = module.configure_optimizers()
    if returned is None:
        raise TaskConfigError(
            f"{task}: {type(module).__qualname__}.configure_optimizers returned None; "
            "it must return the optimizer"
        )
    optimizers, _, _ = _configure_optimizers(returned)
    if len(optimizers) != 1:
        raise TaskConfigError(
            f"{task}: {type(module).__qualname__}.configure_optimizers returned "
            f"{len(optimizers)} optimizers; automatic optimization needs exactly one"
        )
    optimizer: torch.optim.Optimizer = optimizers[0]
    return optimizer


# -------------------------------------------------------------------- the traced step


def trace_lightning(task: LightningTask, config: Config, plan: Plan, target: Target) -> Trace:
    """Trace `TRACED_STEPS` Lightning optimizer steps; raises CannotTrace with a reason."""
    started = time.perf_counter()
    micro, accumulation = lightning_micro_batch(task.batch_size(config), plan)
    samples = task.sample_batch(config, micro)
    tracker = MemoryTracker(
        device_type=target.device.type, record_events=target.cuda, correct=correct_fake
    )
    emulation: AbstractContextManager[None] = cuda_emulation() if target.emulate else nullcontext()
    try:
        # The predictor's own trace context: deep copies as clones in the same fake mode
        # (nn.TransformerEncoder copies its layer), the real kernels' storages, fake fixes.
        fake = FakeTensorMode()
        with fake, _FakeDeepcopy(), emulation, real_kernel_storages(), tracker:
            with torch.device(target.device):
                module = task.build_module(config, plan)
            module.train()
            logged = _keep_logged_values(module)
            optimizer = optimizer_of(task.name, module)
            if target.cuda:
                prefer_foreach(optimizer)
            tracker.watch_optimizer(optimizer)
            batches = _like_batches(samples.train, samples.prefetch, target.device)
            # Held by the loader's iterator through the run (host memory: the CPU card only).
            residue = torch.empty(
                samples.residue_bytes if target.device.type == "cpu" else 0, dtype=torch.uint8
            )
            loss = None
            validated: list[torch.Tensor] = []
            for step in range(TRACED_STEPS):
                loss = lightning_step(module, optimizer, batches, accumulation, step, plan, target)
                tracker.label_training_state(module, optimizer)
                if step == 0 and samples.validation is not None:
                    validated = validation_leftovers(module, samples.validation, target.device)
                    logged = _keep_logged_values(module)
            # The step's closure result, its loss, dies with the step: validation runs without.
            del loss
            part = None
            if samples.validation is not None and _validates(module):
                # Lightning's data is loaded before its loop runs (no warm-up pass), and the
                # trace's batches are fake already.
                release = samples.validates_between_steps(accumulation)
                part = evaluation_part(
                    lambda: validation_loop(module, samples.validation, plan, target, release),
                    fake,
                    tracker,
                    warm_up=False,
                    real_factories=False,
                )
            del logged, validated, residue
    except (TaskConfigError, MemoryLimitExceeded):
        raise
    except Exception as error:
        raise CannotTrace(untraceable_reason(error)) from error
    return Trace.counted(tracker, started, part)


def _validation_autocast(plan: Plan, device: torch.device) -> AbstractContextManager[object]:
    """Lightning's bf16 autocast, which caches no casts: each weight's bf16 copy dies after
    its layer (with autograd off, nothing keeps it)."""
    if not plan.bf16:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=False)


VALIDATED_BATCHES = 2
"""The second validation batch runs beside what the first left (its logged values): every
later one starts from the same live set."""


def validation_loop(
    module: L.LightningModule, sample: Any, plan: Plan, target: Target, release: bool
) -> None:
    """Lightning's validation as `fit` runs it: the gradients released when it runs between
    steps (`on_validation_model_zero_grad`; `release`), else beside them, the module in eval
    mode, no autograd, the precision's autocast, `validation_step` over batches of the
    validation loader's first batch's shapes (the last, smaller batch of a loader cannot set
    the peak)."""
    if release:
        module.on_validation_model_zero_grad()
    module.eval()
    try:
        with torch.no_grad(), _validation_autocast(plan, target.device):
            batches = _like_batches(sample, False, target.device)
            for index in range(VALIDATED_BATCHES):
                batch = next(batches)
                module.validation_step(batch, index)
                del batch
    finally:
        module.train()


def _like_batches(sample: Any, prefetch: bool, device: torch.device) -> Iterator[Any]:
    """Endless batches of `sample`'s structure, shapes and dtypes, made by a tensor factory
    (as a DataLoader's collate makes each batch anew).

    Lightning's data fetcher prefetches one batch only from a loader without a length (an
    iterable dataset): it needs it to tell the last batch. The generator keeps no reference
    to a batch it handed out: the loop's batch dies with its step, as Lightning's does.
    """

    def make() -> Any:
        return tree_map_only(
            torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device=device), sample
        )

    prefetched = [make()] if prefetch else []
    while True:
        prefetched.append(make())
        yield prefetched.pop(0)


def _keep_logged_values(module: L.LightningModule) -> dict[str, torch.Tensor]:
    """Make the module's `self.log` keep a detached copy of each tensor it logs, by name, as
    Lightning's result collection does through the run; returns what it keeps. (Without a
    Trainer, `LightningModule.log` would only warn.)"""
    kept: dict[str, torch.Tensor] = {}

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, torch.Tensor):
            kept[name] = value.detach().clone()

    def log_dict(values: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        for name, value in values.items():
            log(name, value)

    # On the instance, for the trace only: the class stays the user's.
    module.log = log  # type: ignore[method-assign]
    module.log_dict = log_dict  # type: ignore[method-assign,assignment]
    return kept


def _validates(module: L.LightningModule) -> bool:
    """Whether the module defines a validation_step (Lightning skips validation otherwise)."""
    return type(module).validation_step is not L.LightningModule.validation_step


def validation_leftovers(
    module: L.LightningModule, sample: Any, device: torch.device
) -> list[torch.Tensor]:
    """Run `validation_step` once (no grad) and return what Lightning keeps of it
    through the rest of training: per logged name, the epoch-level running sum and batch
    count of its `_ResultMetric` and the mean in `trainer.callback_metrics`.

    The worker validates every `eval_every` steps, so from the first validation on every
    training step runs beside these (three 512-byte blocks per name on the card's count).
    Lightning frees the gradients before validating: the step right after a validation runs
    its forward without the last step's; the trace keeps them (the steady state whenever
    `eval_every` > 1, and an over-prediction, never an under-, when it is 1).
    """
    if not _validates(module):
        return []
    logged = _keep_logged_values(module)
    batch = next(_like_batches(sample, False, device))
    size = _batch_size_of(batch)
    # Left in train mode: only what it logs is kept, and in eval mode some modules take fused
    # inference kernels (nn.TransformerEncoderLayer's fast path) that read fake tensors'
    # data pointers.
    with torch.no_grad():
        module.validation_step(batch, 0)
    del batch
    kept: list[torch.Tensor] = []
    with torch.no_grad():
        for value in logged.values():
            total = value.float().mean() * size
            count = torch.tensor(float(size))
            kept += [total, count, total / count]
    return kept


def _batch_size_of(batch: Any) -> int:
    """The first dimension of the batch's first tensor (Lightning's own guess, simplified)."""
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def lightning_step(
    module: L.LightningModule,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[Any],
    accumulation: int,
    step: int,
    plan: Plan,
    target: Target,
) -> torch.Tensor:
    """One optimizer step as Lightning's automatic optimization runs it (see the module
    docstring); returns the last micro-batch's detached loss, which the loop keeps.

    Only the first two micro-batches and the last run (`traced_indices`): the first makes the
    gradients, the last steps the optimizer, and every one between starts from the second's
    live set and allocates what it does, so a trace costs the same at any accumulation.
    """
    kept = torch.zeros(())
    for index in traced_indices(accumulation):
        batch_idx = step * accumulation + index
        batch = next(batches)
        with autocast_for(plan, target.device):
            output = module.training_step(batch, batch_idx)
        loss = _loss_of(output) / accumulation
        kept = loss.detach().clone()  # ClosureResult.loss
        if index == 0:
            module.optimizer_zero_grad(step, batch_idx, optimizer)
        module.backward(loss)
        if index == accumulation - 1:
            optimizer.step()
        del batch, output, loss
    return kept


def traced_indices(accumulation: int) -> list[int]:
    """The micro-batches of a step the trace runs: the first two and the last."""
    return sorted({0, min(1, accumulation - 1), accumulation - 1})


def _loss_of(output: Any) -> torch.Tensor:
    """The loss of a training_step's output (a tensor, or a mapping with "loss")."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise TaskConfigError(
            "training_step must return the loss tensor or a dict with a 'loss' tensor, "
            f"got {type(output).__qualname__}"
        )
    return loss


# -------------------------------------------------------------------- metrics and pruning


class _ReportingCallback(L.Callback):
    """Reports the monitored metric after each validation and stops a pruned or stopped run
    (Optuna's ``PyTorchLightningPruningCallback`` convention, through the worker's reporter);
    each validation runs in the meter's evaluation window, its peak measured apart."""

    def __init__(self, monitor: str, reporter: Reporter, meter: PeakMeter) -> None:
        self.monitor = monitor
        self.reporter = reporter
        self.meter = meter
        self.measured = meter.measured
        self.last_value: float | None = None
        self.last_step = -1
        self.started = time.monotonic()
        self.eval_seconds = 0.0
        self._eval_started = 0.0
        self._window = ExitStack()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        """Stop between steps when the agent asks (study paused, lease lost, SIGTERM)."""
        reason = self.reporter.stop_reason()
        if reason is not None:
            raise Stopped(reason, self.measured())

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Refuse what Lightning would only warn about: a run without exactly one optimizer."""
        optimizers = [o for o in trainer.optimizers if not isinstance(o, _MockOptimizer)]
        if len(optimizers) != 1:
            raise TaskConfigError(
                f"{type(module).__qualname__}.configure_optimizers returned "
                f"{'None' if not optimizers else f'{len(optimizers)} optimizers'}; "
                "automatic optimization needs exactly one optimizer"
            )

    def on_validation_start(self, trainer: L.Trainer, *args: Any) -> None:
        """Open the meter's evaluation window (Lightning has released the gradients and put
        the module in eval mode) and start the evaluation clock (throughput counts training
        time only)."""
        self._window.enter_context(self.meter.evaluation())
        self._eval_started = time.monotonic()

    def on_exception(self, trainer: L.Trainer, *args: Any) -> None:
        """Close a window a failed validation left open (the meter's phase with it)."""
        self._window.close()

    def on_validation_end(self, trainer: L.Trainer, *args: Any) -> None:
        """Close the evaluation window; report the monitored value; raise Stopped("pruned")
        when the pruner says so."""
        self._window.close()
        self.eval_seconds += time.monotonic() - self._eval_started
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return  # final_value's own validation reports nothing
        value = self.value_of(trainer)
        self.last_value, self.last_step = value, trainer.global_step
        if self.reporter.report(trainer.global_step, value):
            raise Stopped("pruned", self.measured())

    def value_of(self, trainer: L.Trainer) -> float:
        """The monitored metric, as a float; a clear error when validation never logged it."""
        logged = trainer.callback_metrics.get(self.monitor)
        if logged is None:
            known = ", ".join(sorted(trainer.callback_metrics)) or "nothing"
            raise TaskConfigError(
                f"monitor: validation logged no {self.monitor!r} (it logged {known})"
            )
        return float(logged)

    def final_value(
        self, trainer: L.Trainer, module: L.LightningModule, datamodule: L.LightningDataModule
    ) -> float:
        """The metric at the last step: validated again unless the last step was validated."""
        if self.last_value is not None and self.last_step == trainer.global_step:
            return self.last_value
        began = time.monotonic()
        # Training is over: its last gradients are released first, as Lightning does before
        # a validation between steps (the validation the prediction traces).
        module.zero_grad(set_to_none=True)
        trainer.validate(module, datamodule=datamodule, verbose=False)
        self.eval_seconds += time.monotonic() - began
        value = self.value_of(trainer)
        if not math.isfinite(value):
            raise TaskConfigError(f"monitor: {self.monitor} is {value} (training diverged)")
        return value

    def train_seconds(self) -> float:
        """Seconds spent training, evaluation excluded."""
        return time.monotonic() - self.started - self.eval_seconds
