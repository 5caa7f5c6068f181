"""Trace two training steps of a task under FakeTensorMode and count their live storages.

The trace runs `worker.trial.steps.train_step`, the trainer's own step, on a model and optimizer
built inside the fake mode, so what it counts is what the trainer allocates (a model that
cannot be built there is built outside and converted, tied parameters kept tied:
vramtune/worker/predictor/conversion.py). Step 2 is the steady state: optimizer state exists.

On the CPU card step 1's forward and backward are not traced: they allocate what step 2's do
less the optimizer state, so they never set the peak. Step 1 is replayed as what it leaves and
what its optimizer step sees — zero gradients for every trainable parameter, the loss
accumulator, then `optimizer.step()` creating the state — which halves a trace (tested equal to
two traced steps). A CUDA trace keeps both steps: the caching allocator's reserve depends on
the order step 1 allocated in.
Bytes are counted by `worker.device.memory.MemoryTracker`, the same mode that measures real CPU
runs; the only prediction-side difference is a named correction of fake kernels (`correct_fake`).

A step of many micro-batches is traced as its first two and its tail
(`worker.trial.steps.traced_micro_batch_sizes`): the third and later start from the second's live
set, so they allocate what it allocates, and a trace no longer grows with the accumulation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    unset_fake_temporarily,
)
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from vramtune.service.wire import Plan
from vramtune.worker.device.memory import MemoryLimitExceeded, MemoryTracker
from vramtune.worker.predictor.conversion import BuildFailed, build_for_trace
from vramtune.worker.predictor.emulation import answer_scalar_reads, cuda_emulation, prefer_foreach
from vramtune.worker.predictor.evaluation import UNTRACED_BOUND, trace_evaluation
from vramtune.worker.predictor.opmodel import real_kernel_storages
from vramtune.worker.predictor.repeats import replayed
from vramtune.worker.trial.offload import traced_host
from vramtune.worker.trial.runner import CardSpec
from vramtune.worker.trial.steps import (
    build_optimizer_for_plan,
    evaluate_step,
    traced_micro_batch_sizes,
    train_step,
)
from vramtune.worker.trial.task import Batch, Config, Task, TaskConfigError

TRACED_STEPS = 2


class CannotTrace(Exception):
    """The configuration cannot be traced under fake tensors; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Target:
    """Where a trace runs and which card's memory rules it models.

    Attributes:
        device: the fake tensors' device (cpu, or cuda on a CUDA build with a GPU).
        cuda: model a CUDA card (foreach optimizers, caching allocator, card constants).
        emulate: trace on fake cpu with CUDA's kernel choices and autocast policy emulated.
    """

    device: torch.device
    cuda: bool
    emulate: bool

    @property
    def name(self) -> str:
        """'cpu', 'cuda' (fake cuda) or 'cuda-emulated' (fake cpu emulating CUDA)."""
        if not self.cuda:
            return "cpu"
        return "cuda-emulated" if self.emulate else "cuda"


CPU_TARGET = Target(torch.device("cpu"), cuda=False, emulate=False)
EMULATED_CUDA_TARGET = Target(torch.device("cpu"), cuda=True, emulate=True)


def target_for(card: CardSpec | None) -> Target:
    """The trace for `card`: plain fake cpu for the simulated card, else the CUDA rules."""
    if card is None or card.device == "cpu":
        return CPU_TARGET
    if torch.cuda.is_available():
        return Target(torch.device(card.device), cuda=True, emulate=False)
    return EMULATED_CUDA_TARGET


@dataclass
class Trace:
    """What a traced run counted: the live-bytes peak, its breakdown and the allocation events."""

    peak_bytes: int
    breakdown: dict[str, int]
    events: list[tuple[int, int]]
    seconds: float
    phase_peaks: dict[str, int]
    """The highest live bytes while each phase (forward, backward, optimizer...) allocated."""
    training: TrainingPart
    """Where the training steps ended and the evaluation began."""

    @classmethod
    def counted(
        cls, tracker: MemoryTracker, started: float, training: TrainingPart | None = None
    ) -> Trace:
        """What `tracker` counted over a trace begun at `started` (a perf_counter time);
        without `training`, all of it is the training steps' (a framework's own loop)."""
        if training is None:
            training = TrainingPart(tracker.peak_bytes, len(tracker.events or []), None)
        return cls(
            peak_bytes=tracker.peak_bytes,
            breakdown=tracker.breakdown(),
            events=tracker.events or [],
            seconds=time.perf_counter() - started,
            phase_peaks=dict(tracker.phase_peaks),
            training=training,
        )

    @property
    def evaluation_traced(self) -> bool:
        """Whether the task's evaluation was traced to its end."""
        return self.training.evaluation_reason == ""


@dataclass(frozen=True)
class TrainingPart:
    """The training steps' share of a trace: their peak and their allocation events (the
    first `events` of the trace's).

    `evaluation_reason` is "" when the evaluation after them was traced, why not when it was
    not, None when the trace had no evaluation of its own to trace (a framework's loop)."""

    peak_bytes: int
    events: int
    evaluation_reason: str | None = ""


def trace_training(
    task: Task, config: Config, plan: Plan, target: Target, *, real_first_step: bool | None = None
) -> Trace:
    """Trace `TRACED_STEPS` steps of `task` under `plan`; raises CannotTrace with a reason.

    `real_first_step` traces everything the trainer runs (default: on CUDA targets only): step
    1's forward and backward, and step 2's every micro-batch that `traced_micro_batch_sizes`
    keeps, where otherwise those are replayed as what they leave (`_replayed_micro_batches`).
    """
    if real_first_step is None:
        real_first_step = target.cuda
    started = time.perf_counter()
    tracker = MemoryTracker(
        device_type=target.device.type, record_events=target.cuda, correct=correct_fake
    )
    fake = FakeTensorMode()
    try:
        with (
            fake,
            _FakeDeepcopy(),
            _emulation(target),
            _host(target),
            real_kernel_storages(),
            tracker,
        ):
            training = _run_steps(task, config, plan, target, (fake, tracker), real_first_step)
    except (TaskConfigError, MemoryLimitExceeded):
        raise
    except CannotTrace:
        raise
    except BuildFailed as error:
        raise CannotTrace(str(error)) from error
    except Exception as error:
        raise CannotTrace(untraceable_reason(error)) from error
    return Trace.counted(tracker, started, training)


def _emulation(target: Target) -> AbstractContextManager[None]:
    return cuda_emulation() if target.emulate else nullcontext()


def _host(target: Target) -> AbstractContextManager[None]:
    """The host memory of a CUDA target's offload rungs, which its tracker does not count: fake
    cpu beside fake cuda, meta beside fake cpu emulating a card. A CPU target has none (the
    rungs are refused there: host and card are one memory)."""
    if not target.cuda:
        return nullcontext()
    return traced_host(torch.device("cpu" if target.device.type == "cuda" else "meta"))


def _run_steps(
    task: Task,
    config: Config,
    plan: Plan,
    target: Target,
    modes: tuple[FakeTensorMode, MemoryTracker],
    real_first_step: bool,
) -> TrainingPart:
    """The training steps, then the evaluation the trainer runs after them."""
    fake, tracker = modes
    device = target.device
    batch_size = int(config[task.batch_size_param])
    # Built straight on the trace device (Module.to cannot move fake parameters), or outside
    # the fake mode and converted when the build reads tensor values.
    built_from = len(tracker.events or [])
    model = build_for_trace(task, config, plan, device)
    if target.cuda:
        _forget_build_transients(tracker, built_from)
    refuse_compiled(model)
    optimizer = build_optimizer_for_plan(task, model, config, plan)
    if target.cuda:
        prefer_foreach(optimizer)
    if plan.optimizer is not None:
        answer_scalar_reads(optimizer)
    tracker.watch_optimizer(optimizer)

    def next_batch(size: int) -> Batch:
        return task.example_batch(config, size, device)

    own_step = getattr(task, "own_step", None)
    if own_step is not None:
        return _run_own_steps(own_step, model, optimizer, next_batch, batch_size, tracker)
    sizes = traced_micro_batch_sizes(batch_size, plan)
    loss = None
    for step in range(TRACED_STEPS):
        if step == 0 and not real_first_step:
            loss = _first_step_state(model, optimizer, device, tracker)
        elif not real_first_step and _replayable(sizes):
            optimizer.zero_grad(set_to_none=True)
            with tracker.phase("backward"), torch.no_grad():
                _zero_gradients(model)
            loss = train_step(
                task,
                model,
                optimizer,
                next_batch,
                batch_size,
                plan,
                device,
                sizes[1:2],
                accumulating=True,
            )
        else:
            # Kept across the next step, as the trainer's loop keeps its last loss.
            loss = train_step(task, model, optimizer, next_batch, batch_size, plan, device, sizes)
        tracker.label_training_state(model, optimizer)
    # The trainer's last loss is still alive when it evaluates: `loss` is kept until then.
    # A CPU trace replays the calls the task marks repeated (a CUDA one keeps every event).
    with nullcontext() if target.cuda else replayed(tracker):
        part = evaluation_part(
            lambda: evaluate_step(task, model, optimizer, config, plan, device), fake, tracker
        )
    del loss
    return part


OwnStep = Callable[[nn.Module, Batch, torch.optim.Optimizer], object]
"""A user's own training step, `step(model, batch, optimizer)`, run as written
(`vramtune.worker.fit`): its forward, backward and optimizer step are its own."""


def _run_own_steps(
    own_step: OwnStep,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    next_batch: Callable[[int], Batch],
    batch_size: int,
    tracker: MemoryTracker,
) -> TrainingPart:
    """`TRACED_STEPS` calls of a user's own step, as the loop ``for batch in batches: out =
    step(model, batch, optimizer)`` runs them: each batch is made while the previous one and the
    previous step's result are still referenced, and both steps are traced whole (none is
    replayed: what the user's step keeps alive, zeroes or frees is its own). Nothing is
    evaluated: the loop has no evaluation of vramtune's (the part's reason is then None)."""
    batch: Batch | None = None
    out: object = None
    for _ in range(TRACED_STEPS):
        batch = next_batch(batch_size)
        out = own_step(model, batch, optimizer)
        tracker.label_training_state(model, optimizer)
    del batch, out
    return TrainingPart(tracker.peak_bytes, len(tracker.events or []), None)


def _forget_build_transients(tracker: MemoryTracker, built_from: int) -> None:
    """Keep of the build only what outlives it, on a CUDA trace: the real run builds its model
    on the host and moves it to the card (`build_for_plan`), so the card holds the finished
    model and never what building it made and dropped there (a build that failed under fake
    tensors, a QLoRA base's float weights before quantization: gigabytes on a 1B model). The
    events of storages made and freed since `built_from` are dropped, and the peak starts
    again from what is live.

    On the CPU card the real run builds on the card, so all of it is kept there.
    """
    if tracker.events is None:
        return
    freed = {storage for storage, change in tracker.events[built_from:] if change < 0}
    tracker.events[built_from:] = [
        event for event in tracker.events[built_from:] if event[0] not in freed
    ]
    tracker.reset_peak()


def evaluation_part(
    evaluate: Callable[[], object],
    fake: FakeTensorMode,
    tracker: MemoryTracker,
    *,
    warm_up: bool = True,
    real_factories: bool = True,
) -> TrainingPart:
    """The training steps' part of the trace so far, then `evaluate` traced after them
    (`trace_evaluation`); an evaluation that cannot be traced is bounded, not fatal, and the
    part's reason says why."""
    trained = (tracker.peak_bytes, len(tracker.events or []))
    try:
        trace_evaluation(evaluate, fake, tracker, warm_up=warm_up, real_factories=real_factories)
    except MemoryLimitExceeded:
        raise
    except Exception as error:
        return TrainingPart(*trained, UNTRACED_BOUND.format(why=untraceable_reason(error)))
    return TrainingPart(*trained)


def _replayable(sizes: list[int]) -> bool:
    """Whether a step of these micro-batches is traced as its second alone (on the CPU card).

    The second of two equal micro-batches allocates what the first does with every gradient
    already held (each gradient is added into in place rather than made), so at every point it
    holds at least what the first did; a smaller tail runs the same operators on smaller
    tensors from the same live set. Neither can set a phase's peak: the first is replayed as
    the gradients it leaves (made in the backward phase, as it makes them), the tail dropped.
    Tested equal to tracing every micro-batch (tests/worker/test_predictor_phases.py).
    """
    return len(sizes) >= 2 and sizes[0] == sizes[1]


def _zero_gradients(model: nn.Module) -> None:
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)


def _first_step_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, tracker: MemoryTracker
) -> torch.Tensor:
    """What step 1 leaves and its optimizer step sees, without its forward and backward.

    At step 1's `optimizer.step()` the live tensors are the parameters, one gradient per
    trainable parameter and the loss accumulator; the step then creates the optimizer state.
    Returns the accumulator, which the trainer keeps through step 2 as its last loss. A
    parameter the loss never reaches gets a gradient and optimizer state here but none in a real
    step: the prediction is then higher than the run, never lower.
    """
    optimizer.zero_grad(set_to_none=True)
    # The accumulator step 1 returns is made after its backward: in that phase, as train_step's
    with tracker.phase("backward"):
        total = torch.zeros((), device=device)
    with tracker.phase("setup"), torch.no_grad():
        _zero_gradients(model)
    optimizer.step()
    return total


class _FakeDeepcopy(TorchFunctionMode):
    """copy.deepcopy of a fake tensor as a clone in the same fake mode.

    torch's own deepcopy of a fake tensor lands in another fake mode, which then refuses to mix
    (nn.TransformerEncoder deep-copies its layer); a clone is what a real deepcopy allocates.
    """

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is not torch.Tensor.__deepcopy__:
            return func(*args, **(kwargs or {}))
        tensor, memo = args
        if id(tensor) not in memo:
            with torch.no_grad():
                copy = tensor.clone()
            if isinstance(tensor, nn.Parameter):
                copy = nn.Parameter(copy, requires_grad=tensor.requires_grad)
            else:
                copy.requires_grad_(tensor.requires_grad)
            memo[id(tensor)] = copy
        return memo[id(tensor)]


def correct_fake(func: Any, args: tuple[Any, ...], out: Any) -> Any:
    """Fix the fake CPU LSTM/GRU kernels' outputs where they hold less than the real ones.

    - `mkldnn_rnn_layer` returns an empty workspace; oneDNN sizes it from the shapes alone, so
      one real call on zeros of the same shapes (cached) tells the size.
    - `mkldnn_rnn_layer_backward`'s fake kernel returns one tensor as both bias gradients (the
      real kernel returns two; FakeTensorMode's cache replays them as two, so the first call at a
      shape counted one bias gradient less than every later one).

    - The CPU kernels of `mse_loss`, `smooth_l1_loss`, `soft_margin_loss` and
      `binary_cross_entropy` return a reduced (0-d) loss that views their whole elementwise
      buffer: a training loop that keeps the loss alive keeps that buffer (a model from outside
      this repository was under-predicted by 0.70 %, issue 29). The fake kernels return 4 bytes.

    Every other output is kept.
    """
    if func in _LOSSES_VIEWING_THEIR_BUFFER and out.dim() == 0 and out.device.type == "cpu":
        numel = torch.broadcast_shapes(args[0].shape, args[1].shape).numel()  # type: ignore[no-untyped-call]
        return torch.empty(numel, dtype=out.dtype, device=out.device)[0]
    if func is torch.ops.aten.mkldnn_rnn_layer.default:
        size = _onednn_workspace_bytes(args)
        return (*out[:3], torch.empty(size, dtype=torch.uint8, device=out[3].device))
    if func is torch.ops.aten.mkldnn_rnn_layer_backward.default and _same_storage(out[3], out[4]):
        return (*out[:4], out[4].clone(), *out[5:])
    return out


_LOSSES_VIEWING_THEIR_BUFFER = frozenset(
    {
        torch.ops.aten.mse_loss.default,
        torch.ops.aten.smooth_l1_loss.default,
        torch.ops.aten.soft_margin_loss.default,
        torch.ops.aten.binary_cross_entropy.default,
    }
)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage() is b.untyped_storage()  # one Python object per storage


_WORKSPACES: dict[tuple[Any, ...], int] = {}


def _onednn_workspace_bytes(args: tuple[Any, ...]) -> int:
    key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in args)
    if key not in _WORKSPACES:
        with unset_fake_temporarily():
            zeros = tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype), args)
            workspace = torch.ops.aten.mkldnn_rnn_layer.default(*zeros)[3]
        _WORKSPACES[key] = workspace.untyped_storage().nbytes()
    return _WORKSPACES[key]


def refuse_compiled(model: nn.Module) -> None:
    """Raise CannotTrace for a model that torch.compile wrapped (fake tensors cannot run it)."""
    compiled = isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or any(
        getattr(module, "_compiled_call_impl", None) is not None for module in model.modules()
    )
    if compiled:
        raise CannotTrace("the model is compiled with torch.compile, which fake tensors cannot run")


def untraceable_reason(error: BaseException) -> str:
    """Why a trace failed, in words a user can act on."""
    if isinstance(error, DataDependentOutputException):
        return (
            f"data-dependent operation {error.func} (a tensor value read in Python: .item(), "
            ".tolist(), an if on a tensor, GradScaler)"
        )
    if isinstance(error, DynamicOutputShapeException):
        return (
            f"operation {error.func} has a data-dependent output shape (nonzero, boolean "
            "masks, unique, bincount)"
        )
    if isinstance(error, UnsupportedFakeTensorException):
        return f"fake tensors do not support this model: {_first_line(error)}"
    return f"tracing failed: {type(error).__name__}: {_first_line(error)}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else "")[:300]
