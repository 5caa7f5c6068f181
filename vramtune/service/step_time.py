"""Step-time model: seconds per optimizer step, fitted from the fleet's own measurements.

Pure Python (no torch, no numpy): the server fits, workers apply, as with the memory
calibration (service/calibration.py). Per (card model, task), the time of one optimizer step of a
configuration under a plan is modelled as

    log step_s = b0 + b1 * log(n * (micro + o)) + b2 * checkpointing + b3 * bf16
                 + b4 * log parameter_bytes + b5 * log as_asked_peak_bytes

where n micro-batches of `micro` samples each pay a fixed overhead worth `o` samples (kernel
launches, an unsaturated device), checkpointing recomputes the forward pass, and the size of
the model and of its as-asked footprint stand for the configuration's work per sample. The
fit is a ridge regression pulled towards the fixed model vramtune used before it had any
measurement (o = 8 samples, time proportional to samples, checkpointing 4/3 slower, bf16 not
slower, size unused), and `o` is chosen on a grid by least squares. With no observation the
fit *is* that fixed model: plans compare exactly as they did. Two plans of one configuration
on one card differ only in n, micro and the flags, so a plan's slowdown needs no intercept;
an absolute time per step is predicted once the card model and task have STEP_TIME_MIN_RUNS
measured runs. Many workers share one fit, and none may move it alone: each worker's runs
weigh alike, and runs far off the fit are dropped (`fit_step_time`); which runs it is given
(the fleet's only from two workers on, the asking worker's own always) is
service.fleet.calibration's. How a worker applies a fit (features, predicted seconds, a plan's
slowdown) is in the wire contract (service/wire.py), which the worker imports; the fit is here.
"""

from __future__ import annotations

import itertools
import math
import operator
import statistics
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from vramtune.common.step_time import (
    coefficients_of,
    default_step_time_fit,
    predicted_step_s,
    step_time_features,
    step_time_prior,
)
from vramtune.service.wire import StepTimeFit, StepTimeObservation

OVERHEAD_GRID = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
PRIOR_WEIGHT = 0.5
"""How many observations' worth of belief the fixed model carries, per coefficient. Chosen by
replaying the tuning-efficiency benchmark's observations online (bench/tuning_efficiency.py,
each run predicted by the fit of the runs before it): on digits-cnn, after 20 runs, weight 2
gave median 12.4 % / p90 41.8 % error, 0.5 gave 9.7 % / 33.7 %; checked on char-transformer,
not used to choose: 22.9 % / 51.1 % against 14.4 % / 45.0 %, and no worse in the first 20 runs.
Weaker (0.1) was no better on char's first runs, where a fit has 3-20 runs for 6 coefficients
(7 since the chunked loss has a term)."""
MAX_OBSERVATIONS = 2000


OUTLIER_FACTOR = 2.0
"""A run measured more than this many times slower or faster than the first fit predicts it is
dropped before the fit is made again: a fabricated time (or a card that was busy) cannot pull
the model by its size, only by its count."""
MAX_REFITS = 4
"""Fits after the first, each judging every run again: a handful settles a minority of
outliers (the first, pulled fit can misjudge honest runs; the second no longer is pulled)."""

Runs = list[tuple[StepTimeObservation, Hashable]]
"""Measured runs, each with the worker that reported it."""


def fit_step_time(
    card_model: str,
    task: str,
    observations: Iterable[StepTimeObservation],
    workers: Iterable[Hashable] | None = None,
) -> StepTimeFit:
    """The model for one (card model, task) from measured runs (step_s > 0), newest first.

    ``workers`` names the worker that reported each run (None: one reporter). Each worker's
    runs carry equal total weight, so a worker with 100 runs counts as much as one with 3; the
    first fit is re-centred on the weighted median of its errors (the intercept is free), runs
    more than OUTLIER_FACTOR off it are dropped, and the rest are fitted again; every run is
    judged again by that fit, until the runs kept no longer change (at most MAX_REFITS fits
    more). A minority of workers reporting absurd times is dropped whole, and honest runs that
    the first, pulled fit misjudged come back. With nothing to drop, the first fit is the fit;
    with workers split evenly between times more than 4x apart, nothing is kept and the fit is
    the fixed model.
    """
    measured = list(observations)
    reporters = [None] * len(measured) if workers is None else list(workers)
    pairs = zip(measured, reporters, strict=True)
    runs = [(x, w) for x, w in pairs if x.measured_step_s and x.measured_step_s > 0]
    if not runs:
        return default_step_time_fit(card_model, task)
    design = _Design.of(runs)
    kept = list(range(len(runs)))
    fit = _weighted_fit(card_model, task, design)
    for _ in range(MAX_REFITS):
        trimmed = _within_bound(fit, design)
        if not trimmed:  # no majority, and its halves too far apart: believe neither
            return default_step_time_fit(card_model, task)
        if trimmed == kept:
            break
        kept, fit = trimmed, _weighted_fit(card_model, task, design.only(trimmed))
    own_errors = [relative_error(fit, runs[i][0]) for i in kept]
    return fit.model_copy(update={"median_error": statistics.median(own_errors)})


@dataclass(frozen=True)
class _Design:
    """Runs as the fit reads them, computed once for every fit made of them: for each overhead
    on the grid the feature columns, the log times, and who reported each run."""

    columns: dict[float, list[list[float]]]
    targets: list[float]
    workers: list[Hashable]

    @classmethod
    def of(cls, runs: Runs) -> _Design:
        def columns(overhead: float) -> list[list[float]]:
            rows = [step_time_features(x, overhead) for x, _ in runs]
            return [list(column) for column in zip(*rows, strict=True)]

        return cls(
            {overhead: columns(overhead) for overhead in OVERHEAD_GRID},
            [math.log(x.measured_step_s or 1.0) for x, _ in runs],
            [w for _, w in runs],
        )

    def only(self, keep: Sequence[int]) -> _Design:
        """The runs at positions ``keep``."""
        return _Design(
            {o: [[c[i] for i in keep] for c in cs] for o, cs in self.columns.items()},
            [self.targets[i] for i in keep],
            [self.workers[i] for i in keep],
        )

    def log_errors(self, overhead: float, beta: Sequence[float]) -> list[float]:
        """log(predicted / measured) of each run, by coefficients ``beta``."""
        predicted = [0.0] * len(self.targets)
        for b, column in zip(beta, self.columns[overhead], strict=True):
            scaled = map(operator.mul, column, itertools.repeat(b))
            predicted = list(map(operator.add, predicted, scaled))
        return list(map(operator.sub, predicted, self.targets))


def _within_bound(fit: StepTimeFit, design: _Design) -> list[int]:
    """The positions of the runs within OUTLIER_FACTOR of the fit re-centred on its weighted
    median error."""
    errors = design.log_errors(fit.overhead_samples, coefficients_of(fit))
    centre = _weighted_median(errors, _worker_weights(design.workers))
    bound = math.log(OUTLIER_FACTOR)
    return [i for i, error in enumerate(errors) if abs(error - centre) <= bound]


def _weighted_fit(card_model: str, task: str, design: _Design) -> StepTimeFit:
    """The ridge fit of the best overhead on the grid, each worker's runs weighing alike."""
    weights = _worker_weights(design.workers)
    best: tuple[float, float, list[float]] | None = None
    for overhead in OVERHEAD_GRID:
        columns = design.columns[overhead]
        beta = _ridge(columns, design.targets, weights, step_time_prior(), PRIOR_WEIGHT)
        beta[1:4] = [max(beta[1], 0.0), max(beta[2], 0.0), beta[3]]  # resizing never speeds up
        beta[6] = max(beta[6], 0.0)  # nor does the chunked loss
        beta[9:11] = [max(beta[9], 0.0), max(beta[10], 0.0)]  # nor do the offloads
        beta[11] = min(beta[11], 0.0)  # FSDP2 keeping its parameters gathered never slows down
        errors = design.log_errors(overhead, beta)
        sse = sum(map(operator.mul, weights, map(operator.mul, errors, errors)))
        if best is None or sse < best[0]:
            best = (sse, overhead, beta)
    assert best is not None
    _, overhead, beta = best
    return StepTimeFit(
        card_model=card_model,
        task=task,
        overhead_samples=overhead,
        coefficients=beta,
        n_observations=len(design.targets),
    )


def _worker_weights(workers: Sequence[Hashable]) -> list[float]:
    """Each run's weight: every worker's runs sum to the same, all runs to their count (so
    PRIOR_WEIGHT keeps its meaning, and one worker's runs weigh 1 each as they always did)."""
    counts = Counter(workers)
    return [len(workers) / (len(counts) * counts[w]) for w in workers]


def _weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    """The value at which half the weight lies on either side; halfway between the two middle
    values when the weight splits exactly in two (two workers who disagree: neither wins)."""
    ordered = sorted(zip(values, weights, strict=True))
    total = sum(weights)
    running = 0.0
    for (value, weight), (after, _) in itertools.pairwise([*ordered, ordered[-1]]):
        running += weight
        if math.isclose(running, total / 2, rel_tol=1e-9):
            return (value + after) / 2
        if running > total / 2:
            return value
    return ordered[-1][0]


def relative_error(fit: StepTimeFit, x: StepTimeObservation) -> float:
    """|predicted - measured| / measured for one run (inf when nothing is predicted)."""
    predicted = predicted_step_s(fit, x)
    if predicted is None or not x.measured_step_s:
        return math.inf
    return abs(predicted - x.measured_step_s) / x.measured_step_s


def _ridge(
    columns: list[list[float]],
    targets: list[float],
    weights: list[float],
    prior: list[float],
    weight: float,
) -> list[float]:
    """argmin sum w (x b - y)^2 + weight * |b - prior|^2 over all but the intercept, given
    X by its columns."""
    k = len(prior)
    # Column by column with map (a fraction of the time of a Python loop over rows), the
    # upper half of the symmetric X'WX mirrored.
    weighted = [list(map(operator.mul, column, weights)) for column in columns]
    matrix = [[0.0] * k for _ in range(k)]
    for i, j in itertools.combinations_with_replacement(range(k), 2):
        matrix[i][j] = matrix[j][i] = sum(map(operator.mul, weighted[i], columns[j]))
    vector = [sum(map(operator.mul, column, targets)) for column in weighted]
    for i in range(1, k):  # the intercept is free: no prior on the card's speed
        matrix[i][i] += weight
        vector[i] += weight * prior[i]
    matrix[0][0] += 1e-9
    return _solve(matrix, vector)


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the system is small and well posed)."""
    k = len(vector)
    a = [[*row, v] for row, v in zip(matrix, vector, strict=True)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, k):
            factor = a[r][col] / a[col][col]
            for c in range(col, k + 1):
                a[r][c] -= factor * a[col][c]
    out = [0.0] * k
    for r in reversed(range(k)):
        out[r] = (a[r][k] - sum(a[r][c] * out[c] for c in range(r + 1, k))) / a[r][r]
    return out
