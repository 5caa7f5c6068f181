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
import statistics
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence

from common.step_time import (
    coefficients_of,
    default_step_time_fit,
    predicted_step_s,
    step_time_features,
    step_time_prior,
)
from service.wire import StepTimeFit, StepTimeObservation

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
    kept, fit = runs, _weighted_fit(card_model, task, runs)
    for _ in range(MAX_REFITS):
        trimmed = _within_bound(fit, runs)
        if not trimmed:  # no majority, and its halves too far apart: believe neither
            return default_step_time_fit(card_model, task)
        if trimmed == kept:
            break
        kept, fit = trimmed, _weighted_fit(card_model, task, trimmed)
    own_errors = [relative_error(fit, x) for x, _ in kept]
    return fit.model_copy(update={"median_error": statistics.median(own_errors)})


def _within_bound(fit: StepTimeFit, runs: Runs) -> Runs:
    """The runs within OUTLIER_FACTOR of the fit re-centred on its weighted median error."""
    errors = _log_errors(fit, [x for x, _ in runs])
    centre = _weighted_median(errors, _worker_weights([w for _, w in runs]))
    bound = math.log(OUTLIER_FACTOR)
    return [run for run, error in zip(runs, errors, strict=True) if abs(error - centre) <= bound]


def _weighted_fit(card_model: str, task: str, runs: Runs) -> StepTimeFit:
    """The ridge fit of the best overhead on the grid, each worker's runs weighing alike."""
    weights = _worker_weights([w for _, w in runs])
    targets = [math.log(x.measured_step_s or 1.0) for x, _ in runs]
    best: tuple[float, float, list[float]] | None = None
    for overhead in OVERHEAD_GRID:
        rows = [step_time_features(x, overhead) for x, _ in runs]
        beta = _ridge(rows, targets, weights, step_time_prior(), PRIOR_WEIGHT)
        beta[1:4] = [max(beta[1], 0.0), max(beta[2], 0.0), beta[3]]  # resizing never speeds up
        beta[6] = max(beta[6], 0.0)  # nor does the chunked loss
        sse = sum(
            w * (_dot(r, beta) - t) ** 2 for r, t, w in zip(rows, targets, weights, strict=True)
        )
        if best is None or sse < best[0]:
            best = (sse, overhead, beta)
    assert best is not None
    _, overhead, beta = best
    return StepTimeFit(
        card_model=card_model,
        task=task,
        overhead_samples=overhead,
        coefficients=beta,
        n_observations=len(runs),
    )


def _worker_weights(workers: Sequence[Hashable]) -> list[float]:
    """Each run's weight: every worker's runs sum to the same, all runs to their count (so
    PRIOR_WEIGHT keeps its meaning, and one worker's runs weigh 1 each as they always did)."""
    counts = Counter(workers)
    return [len(workers) / (len(counts) * counts[w]) for w in workers]


def _log_errors(fit: StepTimeFit, runs: Sequence[StepTimeObservation]) -> list[float]:
    """log(predicted / measured) of each run, by the fit's coefficients (whatever its count)."""
    beta = coefficients_of(fit)
    return [
        _dot(step_time_features(x, fit.overhead_samples), beta) - math.log(x.measured_step_s or 1.0)
        for x in runs
    ]


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


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(p * q for p, q in zip(a, b, strict=True))


def _ridge(
    rows: list[list[float]],
    targets: list[float],
    weights: list[float],
    prior: list[float],
    weight: float,
) -> list[float]:
    """argmin sum w (x b - y)^2 + weight * |b - prior|^2 over all but the intercept."""
    k = len(prior)
    weighted = [[w * v for v in r] for r, w in zip(rows, weights, strict=True)]
    matrix = [
        [sum(r[i] * q[j] for r, q in zip(weighted, rows, strict=True)) for j in range(k)]
        for i in range(k)
    ]
    vector = [sum(r[i] * t for r, t in zip(weighted, targets, strict=True)) for i in range(k)]
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
