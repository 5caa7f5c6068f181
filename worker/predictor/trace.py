"""Trace two training steps of a task under FakeTensorMode and count their live storages.

The trace runs `worker.steps.train_step`, the trainer's own step, on a model and optimizer
built inside the fake mode (building outside and converting breaks weight tying), so what it
counts is what the trainer allocates. Step 2 is the steady state: optimizer state exists.
"""

from __future__ import annotations

import time
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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from service.wire import Plan
from worker.memory import MemoryLimitExceeded, MemoryTracker
from worker.predictor.emulation import cuda_emulation, prefer_foreach
from worker.predictor.opmodel import real_kernel_storages
from worker.runner import CardSpec
from worker.steps import build_for_plan, train_step
from worker.task import Batch, Config, Task, TaskConfigError

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


def trace_training(task: Task, config: Config, plan: Plan, target: Target) -> Trace:
    """Trace `TRACED_STEPS` steps of `task` under `plan`; raises CannotTrace with a reason."""
    started = time.perf_counter()
    tracker = MemoryTracker(device_type=target.device.type, record_events=target.cuda)
    fake = FakeTensorMode()
    try:
        with (
            fake,
            _FakeDeepcopy(),
            _emulation(target),
            _onednn_workspaces(),
            real_kernel_storages(),
            tracker,
        ):
            _run_steps(task, config, plan, target, tracker)
    except (TaskConfigError, MemoryLimitExceeded):
        raise
    except CannotTrace:
        raise
    except Exception as error:
        raise CannotTrace(untraceable_reason(error)) from error
    return Trace(
        peak_bytes=tracker.peak_bytes,
        breakdown=tracker.breakdown(),
        events=tracker.events or [],
        seconds=time.perf_counter() - started,
    )


def _emulation(target: Target) -> AbstractContextManager[None]:
    return cuda_emulation() if target.emulate else nullcontext()


def _run_steps(
    task: Task, config: Config, plan: Plan, target: Target, tracker: MemoryTracker
) -> None:
    device = target.device
    batch_size = int(config[task.batch_size_param])
    with torch.device(device):
        # Built straight on the trace device: Module.to cannot move fake parameters.
        model = build_for_plan(task, config, plan, device)
    refuse_compiled(model)
    optimizer = task.build_optimizer(model, config)
    if target.cuda:
        prefer_foreach(optimizer)
    tracker.watch_optimizer(optimizer)

    def next_batch(size: int) -> Batch:
        return task.example_batch(config, size, device)

    loss = None
    for _ in range(TRACED_STEPS):
        # Kept across the next step, as the trainer's loop keeps its last loss.
        loss = train_step(task, model, optimizer, next_batch, batch_size, plan, device)
        tracker.label_training_state(model, optimizer)
    del loss


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


class _OneDnnWorkspaces(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Gives fake `mkldnn_rnn_layer` (the CPU LSTM/GRU) the workspace oneDNN really allocates.

    Its fake kernel returns an empty workspace; oneDNN sizes it from the shapes alone, so one
    real call on zeros of the same shapes (cached) tells the size.
    """

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mkldnn_rnn_layer.default:
            size = _onednn_workspace_bytes(args)
            out = (*out[:3], torch.empty(size, dtype=torch.uint8, device=out[3].device))
        return out


def _onednn_workspaces() -> TorchDispatchMode:
    return _OneDnnWorkspaces()  # type: ignore[no-untyped-call]


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
