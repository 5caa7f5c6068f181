"""Trace two training steps of a task under FakeTensorMode and count their live storages.

The trace runs `worker.steps.train_step`, the trainer's own step, on a model and optimizer
built inside the fake mode (building outside and converting breaks weight tying), so what it
counts is what the trainer allocates. Step 2 is the steady state: optimizer state exists.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedFakeTensorException,
)

from service.wire import Plan
from worker.memory import MemoryLimitExceeded, MemoryTracker
from worker.predictor.emulation import cuda_emulation, prefer_foreach
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
        with fake, _emulation(target), tracker:
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
