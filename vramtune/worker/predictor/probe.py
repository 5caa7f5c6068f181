"""The fallback for models fake tensors cannot trace: measure two small micro-batches for real.

For a plan's micro-batch M the probe builds the model on the card and runs two real training
steps of two micro-batches (gradients of the first are alive during the second, as under
accumulation) at m = M/4 and M/2; the peak is a line in m, extrapolated to M. The peak is
measured in two phases, forward+backward and the optimizer step, each its own line, because at
small m the optimizer step often dominates and hides the activations' slope; the prediction is
the larger line at M. The peak is convex in m, so probing near M keeps the extrapolation short.
Measured points are cached per configuration; a probe that runs out of memory is retried at
smaller micro-batches.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vramtune.service.wire import Plan, Prediction
from vramtune.worker.device.memory import MemoryTracker
from vramtune.worker.trial.runner import CardSpec, plan_for_micro_batch
from vramtune.worker.trial.steps import build_for_plan, build_optimizer_for_plan, train_step
from vramtune.worker.trial.task import Batch, Config, Task

PROBE_STEPS = 2

Peaks = tuple[int, int]
"""(peak allocated, peak reserved) bytes."""


@dataclass(frozen=True)
class Line:
    """bytes(m) = intercept + slope·m, with a slope that is never negative."""

    intercept: float
    slope: float

    @classmethod
    def through(cls, m1: int, y1: int, m2: int, y2: int) -> Line:
        """The line through two measurements (flat when they share m)."""
        slope = max((y2 - y1) / (m2 - m1), 0.0) if m2 != m1 else 0.0
        return cls(y2 - slope * m2, slope)

    def at(self, micro_batch: int) -> int:
        """The bytes at `micro_batch`, never negative."""
        return max(round(self.intercept + self.slope * micro_batch), 0)


@dataclass(frozen=True)
class ProbeFit:
    """Allocated and reserved lines per phase; the peak is the larger phase."""

    allocated: tuple[Line, ...]
    reserved: tuple[Line, ...]

    def at(self, micro_batch: int) -> Peaks:
        """(allocated, reserved) at `micro_batch`; reserved is never below allocated."""
        allocated = max(line.at(micro_batch) for line in self.allocated)
        reserved = max(line.at(micro_batch) for line in self.reserved)
        return allocated, max(reserved, allocated)


def fit(points: list[tuple[int, list[Peaks]]]) -> ProbeFit:
    """Lines through the first and last (m, per-phase peaks) measurement."""
    (m1, first), (m2, last) = points[0], points[-1]
    phases = range(len(first))
    return ProbeFit(
        allocated=tuple(Line.through(m1, first[p][0], m2, last[p][0]) for p in phases),
        reserved=tuple(Line.through(m1, first[p][1], m2, last[p][1]) for p in phases),
    )


class _Meter(Protocol):
    def peaks(self) -> Peaks: ...

    def reset(self) -> None: ...


class _CpuMeter:
    """Tracked live bytes of the real CPU run (the simulated card's measure)."""

    def __init__(self, tracker: MemoryTracker) -> None:
        self.tracker = tracker

    def peaks(self) -> Peaks:
        return self.tracker.peak_bytes, self.tracker.peak_bytes

    def reset(self) -> None:
        self.tracker.reset_peak()


class _CudaMeter:
    """torch's allocated and reserved peaks on the card."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def peaks(self) -> Peaks:
        torch.cuda.synchronize(self.device)
        return (
            torch.cuda.max_memory_allocated(self.device),
            torch.cuda.max_memory_reserved(self.device),
        )

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def probe_micro_batches(micro_batch: int) -> tuple[int, int]:
    """The two micro-batches probed for a plan's `micro_batch`: about a quarter and a half."""
    low = max(1, micro_batch // 4)
    return low, max(low + 1, micro_batch // 2)


PhasePeaks = list[Peaks]
"""Peaks of the forward+backward phase and of the optimizer step."""


def measure_point(
    task: Task, config: Config, micro: int, flags: Mapping[str, Any], card: CardSpec | None
) -> PhasePeaks:
    """Per-phase peaks of two real steps of two micro-batches of `micro` on the card, under a
    plan's `flags` (vramtune.common.plans.plan_flags)."""
    device = torch.device(card.device if card is not None else "cpu")
    plan = plan_for_micro_batch(2 * micro, micro, **flags)
    return _measure(task, config, plan, device)


def _measure(task: Task, config: Config, plan: Plan, device: torch.device) -> list[Peaks]:
    """Per-phase peaks (forward+backward, optimizer step) of two real steps under `plan`."""
    if device.type != "cuda":
        tracker = MemoryTracker(device_type="cpu")
        with tracker:
            return _steps(task, config, plan, device, _CpuMeter(tracker))
    with _clean_card(device):
        return _steps(task, config, plan, device, _CudaMeter(device))


@contextmanager
def _clean_card(device: torch.device) -> Iterator[None]:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def _steps(
    task: Task, config: Config, plan: Plan, device: torch.device, meter: _Meter
) -> list[Peaks]:
    batch_size = micro_total(plan)
    model = build_for_plan(task, config, plan, device)
    optimizer = build_optimizer_for_plan(task, model, config, plan)
    phases: list[Peaks] = [(0, 0), (0, 0)]

    def boundary(phase: int) -> None:
        allocated, reserved = meter.peaks()
        phases[phase] = (max(phases[phase][0], allocated), max(phases[phase][1], reserved))
        meter.reset()

    optimizer.register_step_pre_hook(lambda *_: boundary(0))
    optimizer.register_step_post_hook(lambda *_: boundary(1))

    def next_batch(size: int) -> Batch:
        return task.example_batch(config, size, device)

    loss = None
    for _ in range(PROBE_STEPS):
        loss = train_step(task, model, optimizer, next_batch, batch_size, plan, device)
    del loss
    return phases


def micro_total(plan: Plan) -> int:
    """The effective batch of a probe plan: its micro-batches times their size."""
    return (plan.micro_batch or 1) * plan.accumulation


def probe_prediction(
    points: dict[int, PhasePeaks], micro_batch: int, reason: str, seconds: float
) -> Prediction:
    """A `method="probe"` prediction from the two largest measured points below `micro_batch`."""
    usable = sorted(m for m in points if m <= max(micro_batch, 2))[-2:] or sorted(points)[:2]
    fitted = fit([(m, points[m]) for m in usable])
    allocated, reserved = fitted.at(micro_batch)
    measured = " and ".join(str(m) for m in usable)
    return Prediction(
        peak_allocated_bytes=allocated,
        peak_reserved_bytes=reserved,
        method="probe",
        reason=f"cannot trace ({reason}); measured micro-batches {measured} on the card",
        seconds=seconds,
    )
