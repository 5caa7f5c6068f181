"""Predicted peak memory of a configuration under a plan, and the largest micro-batch that fits.

`predict` traces two training steps (worker/predictor/trace.py), replays their allocations
through the caching-allocator model for a CUDA card, and adds the card's constants; a model
that cannot be traced is measured instead (worker/predictor/probe.py). Predictions are cached
per task, shape-relevant parameters, batch size, plan and card.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch

from service.wire import Calibration, CardConstants, Plan, Prediction, apply_calibration
from worker.predictor.allocator import replay
from worker.predictor.probe import PhasePeaks, measure_point, probe_micro_batches, probe_prediction
from worker.predictor.trace import CannotTrace, Target, Trace, target_for, trace_training
from worker.runner import CardSpec, plan_for_micro_batch
from worker.steps import micro_batch_sizes
from worker.task import Config, Task

CACHE_SIZE = 512
MAX_SEARCH_TRACES = 8
# A confirming trace within this of the line means the peak is affine here: stop searching.
AFFINE_TOLERANCE = 0.002


class _LRU(OrderedDict[Hashable, Any]):
    """A small least-recently-used cache."""

    def get_fresh(self, key: Hashable) -> Any:
        """The cached value (marked recent) or None."""
        if key not in self:
            return None
        self.move_to_end(key)
        return self[key]

    def put(self, key: Hashable, value: Any) -> None:
        """Cache `value`, evicting the oldest entry past CACHE_SIZE."""
        self[key] = value
        self.move_to_end(key)
        while len(self) > CACHE_SIZE:
            self.popitem(last=False)


_PREDICTIONS = _LRU()
_PROBE_POINTS = _LRU()


def clear_cache() -> None:
    """Forget every cached prediction and probe (tests; a task whose code changed)."""
    _PREDICTIONS.clear()
    _PROBE_POINTS.clear()


def footprint(prediction: Prediction) -> int:
    """Bytes the card must hold for the prediction: reserved, or allocated when larger."""
    return max(prediction.peak_reserved_bytes, prediction.peak_allocated_bytes)


def card_constants(card: CardSpec | None) -> CardConstants:
    """The constants measured on `card` (a dict or a CardConstants); zeros when unknown."""
    if card is None:
        return CardConstants()
    raw: Any = card.constants
    if isinstance(raw, CardConstants):
        return raw
    known = CardConstants.model_fields
    return CardConstants(**{k: int(v) for k, v in dict(raw).items() if k in known})


def _hashable(value: object) -> Hashable:
    return value if isinstance(value, Hashable) else repr(value)


def _task_key(task: Task, config: Config) -> tuple[Hashable, ...]:
    names = sorted(set(task.shape_params))
    shapes = tuple((name, _hashable(config.get(name))) for name in names)
    return (type(task).__module__, type(task).__qualname__, task.name, shapes)


def _batch_size(task: Task, config: Config) -> int:
    return int(config[task.batch_size_param])


def _plan_key(task: Task, config: Config, plan: Plan) -> tuple[Hashable, ...]:
    batch = _batch_size(task, config)
    micro = micro_batch_sizes(batch, plan)[0]
    return (batch, micro, plan.checkpointing, plan.bf16)


def predict(
    task: Task,
    config: Config,
    plan: Plan,
    card: CardSpec | None = None,
    *,
    target: Target | None = None,
) -> Prediction:
    """The predicted peak of running `config` under `plan` on `card` (None: the CPU card).

    Uses no device memory for a traceable model; an untraceable one is probed on the card
    (method "probe", with the reason). `target` forces a trace mode (the benchmark).
    """
    started = time.perf_counter()
    target = target or target_for(card)
    constants = card_constants(card) if target.cuda else CardConstants()
    key = (
        _task_key(task, config),
        _plan_key(task, config, plan),
        target,
        constants.model_dump_json(),
    )
    cached: Prediction | None = _PREDICTIONS.get_fresh(key)
    if cached is not None:
        return cached.model_copy(update={"seconds": time.perf_counter() - started})
    try:
        trace = trace_training(task, config, plan, target)
    except CannotTrace as error:
        return _probe(task, config, plan, card, error.reason, started)
    prediction = from_trace(trace, target, constants, time.perf_counter() - started)
    _PREDICTIONS.put(key, prediction)
    return prediction


def from_trace(
    trace: Trace, target: Target, constants: CardConstants, seconds: float
) -> Prediction:
    """A prediction from a trace: live bytes on the CPU card, the allocator model on CUDA."""
    if not target.cuda:
        return Prediction(
            peak_allocated_bytes=trace.peak_bytes,
            peak_reserved_bytes=trace.peak_bytes,
            breakdown=trace.breakdown,
            seconds=seconds,
        )
    peaks = replay(trace.events, preallocated=[constants.cublas_workspace_bytes])
    return Prediction(
        peak_allocated_bytes=peaks.allocated + constants.other_bytes,
        peak_reserved_bytes=peaks.reserved + constants.other_bytes,
        breakdown=trace.breakdown,
        constants=constants.model_dump(),
        seconds=seconds,
    )


def _probe(
    task: Task, config: Config, plan: Plan, card: CardSpec | None, reason: str, started: float
) -> Prediction:
    """Measure (or reuse) the points around the plan's micro-batch and extrapolate."""
    device = card.device if card is not None else "cpu"
    key = (_task_key(task, config), plan.checkpointing, plan.bf16, device)
    points: dict[int, PhasePeaks] = _PROBE_POINTS.get_fresh(key) or {}
    micro = micro_batch_sizes(_batch_size(task, config), plan)[0]
    wanted = list(probe_micro_batches(micro))
    while wanted:
        size = wanted.pop()
        if size in points:
            continue
        try:
            points[size] = measure_point(task, config, size, plan.checkpointing, plan.bf16, card)
        except torch.OutOfMemoryError:
            if size == 1:
                return _does_not_fit(card, reason, started)
            wanted = [max(1, size // 4), max(1, size // 2)]
    _PROBE_POINTS.put(key, points)
    return probe_prediction(points, micro, reason, time.perf_counter() - started)


def _does_not_fit(card: CardSpec | None, reason: str, started: float) -> Prediction:
    """A probe that ran out of memory at micro-batch 1: more than the card holds."""
    beyond = (card.info.total_bytes if card is not None else 0) + 1
    return Prediction(
        peak_allocated_bytes=beyond,
        peak_reserved_bytes=beyond,
        method="probe",
        reason=f"cannot trace ({reason}); the probe ran out of memory at micro-batch 1",
        seconds=time.perf_counter() - started,
    )


# ---------------------------------------------------------------- the largest micro-batch


def largest_micro_batch(
    task: Task,
    config: Config,
    plan: Plan,
    budget_bytes: int,
    card: CardSpec | None = None,
    *,
    calibration: Calibration | None = None,
    target: Target | None = None,
) -> tuple[int, Prediction] | None:
    """The largest micro-batch whose footprint under `plan`'s flags fits `budget_bytes`.

    The whole batch is tried first; otherwise the peak, affine in the micro-batch, is solved
    from the line through two traces and confirmed by a trace at the solution (more traces only
    where the peak is not affine). Predictions are compared calibrated when `calibration` is
    given (and returned so). None when not even a micro-batch of 1 fits.
    """
    batch = _batch_size(task, config)
    flags = {"checkpointing": plan.checkpointing, "bf16": plan.bf16}

    def at(micro: int) -> Prediction:
        plan_at = plan_for_micro_batch(batch, micro, **flags)
        prediction = predict(task, config, plan_at, card, target=target)
        return prediction if calibration is None else apply_calibration(prediction, calibration)

    whole = at(batch)
    if footprint(whole) <= budget_bytes:
        return batch, whole
    one = at(1)
    if batch == 1 or footprint(one) > budget_bytes:
        return None
    return _search(at, batch, one, whole, budget_bytes)


def _search(
    at: Callable[[int], Prediction], batch: int, one: Prediction, whole: Prediction, budget: int
) -> tuple[int, Prediction]:
    """Regula falsi on [fits, does not fit], starting from the line through m=1 and m=batch/2."""
    fits, fails = (1, one), (batch, whole)
    half = math.ceil(batch / 2)
    if 1 < half < batch:
        middle = at(half)
        if footprint(middle) <= budget:
            fits = (half, middle)
        else:
            fails = (half, middle)
    for _ in range(MAX_SEARCH_TRACES):
        if fails[0] - fits[0] <= 1:
            break
        guess, expected = _secant(fits, fails, budget)
        prediction = at(guess)
        if footprint(prediction) > budget:
            fails = (guess, prediction)
            continue
        fits = (guess, prediction)
        if _on_line(footprint(prediction), expected):
            break
    return fits


def _secant(
    fits: tuple[int, Prediction], fails: tuple[int, Prediction], budget: int
) -> tuple[int, float]:
    """The micro-batch where the line through the bracket meets the budget, and the line there."""
    (m0, p0), (m1, p1) = fits, fails
    slope = (footprint(p1) - footprint(p0)) / (m1 - m0)
    guess = m0 + math.floor((budget - footprint(p0)) / slope) if slope > 0 else m1 - 1
    guess = min(max(guess, m0 + 1), m1 - 1)
    return guess, footprint(p0) + slope * (guess - m0)


def _on_line(measured: int, expected: float) -> bool:
    return abs(measured - expected) <= AFFINE_TOLERANCE * max(expected, 1.0)
