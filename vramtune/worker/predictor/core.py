"""Predicted peak memory of a configuration under a plan, and the largest micro-batch that fits.

`predict` traces two training steps (vramtune/worker/predictor/trace.py), replays their allocations
through the caching-allocator model for a CUDA card, and adds the card's constants; a model
that cannot be traced is measured instead (worker/predictor/probe.py). Predictions are cached
per task, shape-relevant parameters, batch size, plan and card.

The peak is the largest of several phases' peaks (forward, backward, the optimizer step), each
affine in the micro-batch: at small micro-batches the optimizer step, which does not depend on
the micro-batch, sets it. `largest_micro_batch` solves the maximum of those lines.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from vramtune.common.memory import apply_calibration, calibrated_bytes, raw_peaks
from vramtune.common.plans import plan_flags
from vramtune.service.wire import Calibration, CardConstants, Plan, Prediction
from vramtune.worker.device import alloc_conf
from vramtune.worker.device.memory import EVALUATION_PHASE
from vramtune.worker.predictor.allocator import replay
from vramtune.worker.predictor.evaluation import UNTRACED_BOUND
from vramtune.worker.predictor.probe import (
    PhasePeaks,
    measure_point,
    probe_micro_batches,
    probe_prediction,
)
from vramtune.worker.predictor.trace import (
    CannotTrace,
    Target,
    Trace,
    target_for,
    trace_training,
    untraceable_reason,
)
from vramtune.worker.predictor.warmup import wait_for_warm_up
from vramtune.worker.trial.runner import CardSpec, micro_batch_choices, plan_for_micro_batch
from vramtune.worker.trial.steps import micro_batch_sizes
from vramtune.worker.trial.task import Config, Task, TaskConfigError

CACHE_SIZE = 512
# A bound on the search's rounds (one trace each); every answer it gives was traced to fit.
MAX_SEARCH_TRACES = 8
MAX_REASON = 4096  # vramtune.service.wire.ShortText


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

TraceListener = Callable[[Task, Config, Plan], None]
_LISTENER: ContextVar[TraceListener | None] = ContextVar("trace_listener", default=None)


@contextmanager
def traces_told(listener: TraceListener) -> Iterator[None]:
    """Tell `listener` each trace `predict` starts inside this context (not a cached answer):
    `vramtune fit`'s progress names the micro-batch a long search is tracing."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)


def clear_cache() -> None:
    """Forget every cached prediction and probe (tests; a task whose code changed)."""
    _PREDICTIONS.clear()
    _PROBE_POINTS.clear()


def footprint(prediction: Prediction) -> int:
    """Bytes the card must hold for the prediction: reserved, or allocated when larger."""
    return max(prediction.peak_reserved_bytes, prediction.peak_allocated_bytes)


def prediction_fits(prediction: Prediction, budget_bytes: int) -> bool:
    """Whether a prediction says the run fits: one that predicts nothing (neither traced nor
    probed, e.g. BatchNorm refusing a micro-batch of 1) never does, though its bytes are 0."""
    return prediction.method != "none" and footprint(prediction) <= budget_bytes


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def largest_fitting_divisor(
    batch: int, plan: Plan, budget_bytes: int, predict: Callable[[Plan], Prediction]
) -> tuple[int, Prediction] | None:
    """The largest micro-batch dividing `batch` whose prediction under `plan`'s flags fits
    `budget_bytes` (bisected: the peak grows with the micro-batch), for loops that accumulate
    whole batches only (the Trainer's, Lightning's); None when none fits."""
    choices = divisors(batch)
    flags = plan_flags(plan)
    found: tuple[int, Prediction] | None = None
    low, high = 0, len(choices)
    while low < high:
        middle = (low + high) // 2
        prediction = predict(plan_for_micro_batch(batch, choices[middle], **flags))
        if prediction_fits(prediction, budget_bytes):
            found, low = (choices[middle], prediction), middle + 1
        else:
            high = middle
    return found


def largest_divisor_on_lines(
    batch: int,
    plan: Plan,
    budget_bytes: int,
    predict: Callable[[Plan], Prediction],
    known: Callable[[Plan], Prediction | None] = lambda plan: None,
) -> tuple[int, Prediction] | None:
    """The largest micro-batch dividing `batch` whose prediction under `plan`'s flags fits
    `budget_bytes`, for a loop that accumulates whole micro-batches and traces slowly (a
    Hugging Face Trainer's: every prediction runs its loop, and a micro-batch of 1 runs a
    window of the whole batch); None when not even 1 fits. `known` gives the predictions made
    already (none is made twice).

    The whole batch is tried first; each round then predicts the largest divisor inside the
    bracket that the training steps' line says fits, and narrows the bracket. Until a
    micro-batch is known to fit, the line runs from what the whole batch's peak holds that
    does not grow with the micro-batch (parameters, their gradients, optimizer state). Past
    the two largest micro-batches predicted that fit (both accumulating) the line never
    over-states the training steps' peak, a maximum of terms affine in the micro-batch: a next
    divisor it puts over the budget, by more than per-storage rounding can hide
    (`_line_slack`), is over, and the search stops short of a closed bracket. Every answer
    was predicted to fit.
    """
    flags = plan_flags(plan)
    choices = divisors(batch)
    plans = {m: plan_for_micro_batch(batch, m, **flags) for m in choices}
    traced = {m: p for m in choices if (p := known(plans[m])) is not None}

    def at(micro: int) -> Prediction:
        if micro not in traced:
            traced[micro] = predict(plans[micro])
        return traced[micro]

    if prediction_fits(at(batch), budget_bytes):
        return batch, traced[batch]
    fits = max((m for m, p in traced.items() if prediction_fits(p, budget_bytes)), default=0)
    fails = min(m for m, p in traced.items() if m > fits and not prediction_fits(p, budget_bytes))
    for _ in choices:
        inside = [m for m in choices if fits < m < fails]
        guess = _guess_on_lines(inside, traced, (fits, fails), budget_bytes)
        if guess is None:
            break
        if prediction_fits(at(guess), budget_bytes):
            fits = guess
        else:
            fails = guess
    return (fits, traced[fits]) if fits else None


def _guess_on_lines(
    inside: list[int], traced: dict[int, Prediction], bracket: tuple[int, int], budget: int
) -> int | None:
    """The next micro-batch to predict within the bracket (`inside`, ascending; its lower end
    0 while none is known to fit); None when there is none, or the line through the two
    largest fitting ones puts the next over."""
    if not inside:
        return None
    fits, fails = bracket
    fitting = sorted(m for m, p in traced.items() if m < fails and prediction_fits(p, budget))
    if len(fitting) >= 2:
        low, high = fitting[-2:]
        line = _TrainingLine(low, _training(traced[low]), high, _training(traced[high]))
        if line.at(inside[0]) > budget + _line_slack(budget):
            return None
    else:
        start = _training(traced[fits]) if fits else _fixed(traced[fails])
        line = _TrainingLine(fits, start, fails, _training(traced[fails]))
    evaluation = (traced[fits].evaluation_peak_bytes or 0) if fits else 0
    within = [m for m in inside if max(line.at(m), evaluation) <= budget]
    return within[-1] if within else inside[0]


@dataclass(frozen=True)
class _TrainingLine:
    """The training steps' peak as a line through two micro-batches' (m0, v0), (m1, v1)."""

    m0: int
    v0: float
    m1: int
    v1: float

    def at(self, micro: int) -> float:
        return _line(self.m0, self.v0, self.m1, self.v1, micro)


def _training(prediction: Prediction) -> int:
    return prediction.training_peak_bytes or footprint(prediction)


def _fixed(prediction: Prediction) -> int:
    """What a peak holds that does not grow with the micro-batch: the parameters, as many
    bytes of gradients (held across an accumulation window) and the optimizer state."""
    breakdown = prediction.breakdown
    return 2 * breakdown.get("parameters", 0) + breakdown.get("optimizer_state", 0)


def _line_slack(budget: int) -> int:
    """What rounding each live storage up to 512 bytes can add to a peak beyond its line: a
    line this close to the budget is confirmed by a prediction, not trusted."""
    return max(budget // 100, 1 << 20)


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
    # A task whose model is not its configuration's (vramtune.fit's ModuleTask: a module in
    # hand) carries a token of its own: two models of one class must not share predictions.
    token = getattr(task, "cache_token", None)
    return (type(task).__module__, type(task).__qualname__, task.name, token, shapes)


def _batch_size(task: Task, config: Config) -> int:
    return int(config[task.batch_size_param])


def _plan_key(task: Task, config: Config, plan: Plan) -> tuple[Hashable, ...]:
    batch = _batch_size(task, config)
    micro = micro_batch_sizes(batch, plan)[0]
    return (batch, micro, *sorted(plan_flags(plan).items()))


def _prediction_key(
    task: Task, config: Config, plan: Plan, target: Target, card: CardSpec | None
) -> tuple[Hashable, ...]:
    constants = card_constants(card) if target.cuda else CardConstants()
    return (
        _task_key(task, config),
        _plan_key(task, config, plan),
        target,
        constants.model_dump_json(),
        allocator_capacity(card, target),
    )


def allocator_capacity(card: CardSpec | None, target: Target) -> int | None:
    """What cudaMalloc can give the caching allocator on `card`: its memory less the CUDA
    context and what else the constants count outside the allocator. Near it the allocator
    frees its cache and retries before an OOM, which the model follows (allocator.py). None
    off a CUDA card (the CPU card, a simulated one, none given)."""
    if card is None or not target.cuda or not card.device.startswith("cuda"):
        return None
    if card.info.simulated:
        return None
    constants = card_constants(card)
    outside = constants.cuda_context_bytes + constants.other_bytes
    return max(card.info.total_bytes - outside, 0)


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
    wait_for_warm_up()  # instead of paying the one-time cost twice
    target = target or target_for(card)
    constants = card_constants(card) if target.cuda else CardConstants()
    key = _prediction_key(task, config, plan, target, card)
    cached: _Point | None = _PREDICTIONS.get_fresh(key)
    if cached is not None:
        return cached.prediction.model_copy(update={"seconds": time.perf_counter() - started})
    listener = _LISTENER.get()
    if listener is not None:
        listener(task, config, plan)
    try:
        trace = trace_training(task, config, plan, target)
    except CannotTrace as error:
        return _bounded_evaluation(_probe(task, config, plan, card, error.reason, started))
    capacity = allocator_capacity(card, target)
    prediction = from_trace(
        trace, target, constants, time.perf_counter() - started, capacity=capacity
    )
    _PREDICTIONS.put(key, _Point(prediction, trace.phase_peaks))
    return prediction


@dataclass(frozen=True)
class _Point:
    """A prediction with the raw peak of each phase it traced (empty for a probe)."""

    prediction: Prediction
    phases: dict[str, int]

    def accumulating(self) -> _Point:
        """The whole batch's point as a step that accumulates would reach it: each gradient
        is then held through forward and backward. Step 1's replayed setup phase made them
        all beside the parameters, which tells their bytes; without it (a CUDA trace, a
        probe) the point is kept as it is."""
        if "setup" not in self.phases:
            return self
        gradients = self.phases["setup"] - self.prediction.breakdown.get("parameters", 0)
        raised = {
            phase: peak + max(gradients, 0) if phase in ("forward", "backward") else peak
            for phase, peak in self.phases.items()
        }
        return _Point(self.prediction, raised)


def phase_peaks(
    task: Task,
    config: Config,
    plan: Plan,
    card: CardSpec | None = None,
    target: Target | None = None,
) -> dict[str, int]:
    """The raw live-bytes peak of each phase (forward, backward, optimizer, evaluation...) of
    the prediction made just before with these arguments (cached), or none (a probe)."""
    target = target or target_for(card)
    point: _Point | None = _PREDICTIONS.get(_prediction_key(task, config, plan, target, card))
    return point.phases if point is not None else {}


def from_trace(
    trace: Trace,
    target: Target,
    constants: CardConstants,
    seconds: float,
    *,
    capacity: int | None = None,
) -> Prediction:
    """A prediction from a trace: live bytes on the CPU card, the allocator model on CUDA
    (given `capacity`, `allocator_capacity`: with the retry that frees the cache near it).

    The peaks are the whole run's, evaluation included (what the plan must fit); the training
    steps' footprint and the evaluation's ride beside them, for a calibration fitted like
    against like. An evaluation that was not traced is bounded by the training steps' peak
    and the reason says so.
    """
    evaluation = _evaluation_peak(trace)
    if not target.cuda:
        return Prediction(
            peak_allocated_bytes=trace.peak_bytes,
            peak_reserved_bytes=trace.peak_bytes,
            breakdown=trace.breakdown,
            reason=trace.training.evaluation_reason or "",
            seconds=seconds,
            training_peak_bytes=trace.training.peak_bytes,
            evaluation_peak_bytes=evaluation,
        )
    whole = _on_card(trace.events, constants, capacity)
    training = _on_card(trace.events[: trace.training.events], constants, capacity)
    return Prediction(
        peak_allocated_bytes=whole[0],
        peak_reserved_bytes=whole[1],
        breakdown=trace.breakdown,
        constants=constants.model_dump(),
        reason=trace.training.evaluation_reason or "",
        seconds=seconds,
        training_peak_bytes=max(training),
        # The caching allocator keeps the training steps' segments: the card holds the
        # whole run's reserve while evaluating.
        evaluation_peak_bytes=max(whole) if evaluation is not None else None,
    )


def _evaluation_peak(trace: Trace) -> int | None:
    """The live-bytes peak while the evaluation allocated; None where it was not traced."""
    if not trace.evaluation_traced:
        return None
    return trace.phase_peaks.get(EVALUATION_PHASE, 0)


def _on_card(
    events: list[tuple[int, int]], constants: CardConstants, capacity: int | None = None
) -> tuple[int, int]:
    """(allocated, reserved) of these allocation events through the caching-allocator model.

    The model follows this process's PYTORCH_CUDA_ALLOC_CONF: the worker predicts for the card
    it drives, whose real runs allocate under the same settings.
    """
    peaks = replay(
        events,
        preallocated=[constants.cublas_workspace_bytes],
        settings=alloc_conf.from_environ(),
        capacity=capacity,
    )
    return peaks.allocated + constants.other_bytes, peaks.reserved + constants.other_bytes


def _probe(
    task: Task, config: Config, plan: Plan, card: CardSpec | None, reason: str, started: float
) -> Prediction:
    """Measure (or reuse) the points around the plan's micro-batch and extrapolate."""
    device = card.device if card is not None else "cpu"
    flags = plan_flags(plan)
    key = (_task_key(task, config), *sorted(flags.items()), device)
    points: dict[int, PhasePeaks] = _PROBE_POINTS.get_fresh(key) or {}
    micro = micro_batch_sizes(_batch_size(task, config), plan)[0]
    wanted = list(probe_micro_batches(micro))
    while wanted:
        size = wanted.pop()
        if size in points:
            continue
        try:
            points[size] = measure_point(task, config, size, flags, card)
        except torch.OutOfMemoryError:
            if size == 1:
                return _does_not_fit(card, reason, started)
            wanted = [max(1, size // 4), max(1, size // 2)]
        except TaskConfigError:
            raise
        except Exception as error:  # a fallback answers with its reason, never raises
            return _unpredictable(reason, size, error, started)
    _PROBE_POINTS.put(key, points)
    return probe_prediction(points, micro, reason, time.perf_counter() - started)


def _bounded_evaluation(prediction: Prediction) -> Prediction:
    """A probe measures training steps only: its reason says how the evaluation is bounded."""
    if prediction.method != "probe":
        return prediction
    bound = UNTRACED_BOUND.format(why="the training step was probed")
    reason = f"{prediction.reason}; {bound}"[:MAX_REASON]
    return prediction.model_copy(update={"reason": reason})


def _unpredictable(reason: str, size: int, error: Exception, started: float) -> Prediction:
    """No prediction: neither the trace nor the probe's real step at `size` ran (a BatchNorm
    given one value per channel, say). The plan is then chosen blind (method "none")."""
    return Prediction(
        peak_allocated_bytes=0,
        peak_reserved_bytes=0,
        method="none",
        reason=(
            f"cannot trace ({reason}); the probe failed at micro-batch {size}: "
            f"{untraceable_reason(error).removeprefix('tracing failed: ')}"
        )[:MAX_REASON],
        seconds=time.perf_counter() - started,
    )


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
    even: bool = False,
) -> tuple[int, Prediction] | None:
    """The largest micro-batch whose footprint under `plan`'s flags fits `budget_bytes`
    (`even`: the largest of an even split, `vramtune.worker.trial.runner.micro_batch_choices`).

    The whole batch is tried first, then a micro-batch of 1; between them the footprint is
    solved as the maximum of the phases' lines and each solution confirmed by one trace
    (`_search`). Predictions are compared calibrated when `calibration` is given (and returned
    so). None when not even a micro-batch of 1 fits.
    """
    batch = _batch_size(task, config)
    flags = plan_flags(plan)

    def at(micro: int) -> _Point:
        plan_at = plan_for_micro_batch(batch, micro, **flags)
        prediction = predict(task, config, plan_at, card, target=target)
        phases = phase_peaks(task, config, plan_at, card, target)
        if calibration is not None:
            prediction = apply_calibration(prediction, calibration)
        return _Point(prediction, phases)

    def calibrated(raw: float) -> float:
        return raw if calibration is None else float(calibrated_bytes(round(raw), calibration))

    whole = at(batch)
    if prediction_fits(whole.prediction, budget_bytes):
        return batch, whole.prediction
    if batch == 1:
        return None
    one = at(1)
    if not prediction_fits(one.prediction, budget_bytes):
        return None
    traced = {1: one, batch: whole}
    choices = micro_batch_choices(batch, even)
    return _search(at, calibrated, choices, traced, budget_bytes)


def _search(
    at: Callable[[int], _Point],
    calibrated: Callable[[float], float],
    choices: list[int],
    traced: dict[int, _Point],
    budget: int,
) -> tuple[int, Prediction]:
    """The largest of `choices` that fits, from a bracket [1 fits, batch does not].

    Each round solves the phases' lines for the largest choice inside the bracket that they
    say fits and traces it (one trace a round), narrowing the bracket. The lines run through
    the two largest traced micro-batches that fit when there are two (both accumulate
    gradients, as every plan inside does): each phase's peak is a maximum of affine terms, so
    past them the lines never over-state it, and a next choice they put over the budget is
    over. Only then does the search stop short of a closed bracket; through [1, batch] (the
    whole batch keeps no gradients between micro-batches) the lines only guess.
    """
    fits, fails = choices[0], choices[-1]
    for _ in range(MAX_SEARCH_TRACES):
        inside = [m for m in choices if fits < m < fails]
        if not inside:
            break
        below = [m for m in traced if m < fits]
        extrapolating = bool(below)
        anchor = (max(below), fits) if extrapolating else (fits, fails)
        upper = traced[anchor[1]]
        if anchor[1] == choices[-1]:
            upper = upper.accumulating()  # lines of the accumulating plans inside
        lines = _PiecewiseLines((anchor[0], traced[anchor[0]]), (anchor[1], upper), calibrated)
        guess = lines.largest_within(inside, budget)
        if guess is None:
            if extrapolating:
                break  # the next choice is over the budget on lines that under-state it
            guess = inside[0]
        traced[guess] = at(guess)
        if prediction_fits(traced[guess].prediction, budget):
            fits = guess
        else:
            fails = guess
    return fits, traced[fits].prediction


@dataclass(frozen=True)
class _PiecewiseLines:
    """The footprint as the maximum of each phase's line through two traced micro-batches.

    A card's footprint is its reserve (or the constants) above the largest phase peak: that gap
    is taken from the second trace. With a single phase (a probe) it is one line.
    """

    first: tuple[int, _Point]
    second: tuple[int, _Point]
    calibrated: Callable[[float], float]

    def raw(self, micro: int) -> float:
        (m0, p0), (m1, p1) = self.first, self.second
        phases = set(p0.phases) & set(p1.phases)
        if not phases:
            return _line(m0, _raw(p0.prediction), m1, _raw(p1.prediction), micro)
        # Never below the phases: a point raised to accumulate (`_Point.accumulating`).
        gap = max(_raw(p1.prediction) - max(p1.phases.values()), 0)
        return gap + max(
            _line(m0, p0.phases[phase], m1, p1.phases[phase], micro) for phase in phases
        )

    def footprint(self, micro: int) -> float:
        """The footprint the lines give, calibrated as the predictions are compared."""
        return self.calibrated(self.raw(micro))

    def largest_within(self, choices: list[int], budget: int) -> int | None:
        """The largest of the ascending `choices` the lines say fits (lines rise: bisect)."""
        low, high = 0, len(choices)  # choices[:low] fit, choices[high:] do not
        while low < high:
            middle = (low + high) // 2
            if self.footprint(choices[middle]) <= budget:
                low = middle + 1
            else:
                high = middle
        return choices[low - 1] if low else None


def _line(m0: int, v0: float, m1: int, v1: float, micro: int) -> float:
    return v0 + (v1 - v0) * (micro - m0) / (m1 - m0)


def _raw(prediction: Prediction) -> int:
    """The uncalibrated footprint of a (possibly calibrated) prediction."""
    allocated, reserved = raw_peaks(prediction)
    return max(allocated, reserved)
