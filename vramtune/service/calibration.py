"""Calibration from history: fit predicted vs measured peaks to a correction and a margin.

Pure Python (no torch): the server fits here; workers apply the fit with the contract's
``vramtune.service.wire.apply_calibration``. Per (card model, torch version, task),
the measured peak is modelled as ``scale * predicted + offset`` (a robust Theil-Sen line; with
fewer than MIN_FOR_LINE observations the median miss as an offset, scale 1; with enough that
span too little, the median ratio), and the margin is the
conformal (1 - alpha) quantile of the relative under-prediction left after that fit, so that a
new run exceeds ``(scale * predicted + offset) * (1 + margin)`` with probability <= alpha (1 %)
when runs are exchangeable. With fewer than 99 observations that quantile does not exist yet:
the margin is then the largest residual seen plus a share of the default that shrinks as
observations accumulate.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

from vramtune.common.memory import calibrated_bytes
from vramtune.service.wire import Calibration

UNDER_PREDICTION_RATE = 0.01
"""The share of runs allowed to exceed the calibrated prediction."""
DEFAULT_MARGIN = 0.05
"""The margin before any observation (the wire model's default)."""
MAX_MARGIN = 0.9
MIN_FOR_LINE = 10
"""Fewer observations fit a ratio only: a line needs a spread of predictions to stand on."""
MIN_SPREAD = 1.2
"""Largest over smallest prediction below which the offset cannot be told from the scale."""
MAX_LINE_POINTS = 300
"""Theil-Sen uses the newest this many points (pairwise slopes grow as the square)."""
SCALE_BOUNDS = (0.25, 4.0)

Pair = tuple[int, int]
"""(predicted bytes, measured bytes) of one completed run."""


def fit_calibration(
    card_model: str, torch_version: str, task: str, pairs: Iterable[Pair]
) -> Calibration:
    """The correction and margin for one (card model, torch version, task).

    `pairs` are (predicted, measured) peak bytes, newest first; non-positive ones are ignored.
    """
    clean = [(p, m) for p, m in pairs if p > 0 and m > 0]
    scale, offset = _fit_line(clean)
    margin = _margin([m / _corrected(p, scale, offset) - 1.0 for p, m in clean])
    return Calibration(
        card_model=card_model,
        torch_version=torch_version,
        task=task,
        scale=scale,
        offset_bytes=round(offset),
        margin_fraction=margin,
        n_observations=len(clean),
    )


def _fit_line(pairs: Sequence[Pair]) -> tuple[float, float]:
    """(scale, offset): Theil-Sen when the points allow it, else the median offset or ratio."""
    if not pairs:
        return 1.0, 0.0
    if len(pairs) < MIN_FOR_LINE:
        # A few small runs cannot tell a constant miss from a proportional one; as a ratio, a
        # constant miss (memory the prediction did not see, issue 29) would multiply every
        # larger prediction. As an offset it stays the bytes it was.
        return 1.0, statistics.median(m - p for p, m in pairs)
    predicted = [p for p, _ in pairs]
    if max(predicted) < MIN_SPREAD * min(predicted):
        return _bounded(statistics.median(m / p for p, m in pairs)), 0.0
    points = pairs[:MAX_LINE_POINTS]
    slopes = [
        (m2 - m1) / (p2 - p1)
        for i, (p1, m1) in enumerate(points)
        for p2, m2 in points[i + 1 :]
        if p2 != p1
    ]
    scale = _bounded(statistics.median(slopes))
    offset = statistics.median(m - scale * p for p, m in points)
    return scale, offset


def _bounded(scale: float) -> float:
    low, high = SCALE_BOUNDS
    return min(max(scale, low), high)


def _corrected(predicted: float, scale: float, offset: float) -> float:
    """The fitted line at `predicted`, kept positive so relative residuals exist."""
    return max(scale * predicted + offset, 1.0)


def _margin(residuals: list[float]) -> float:
    """The conformal (1 - alpha) quantile of relative under-predictions, or its stand-in."""
    n = len(residuals)
    needed = math.ceil((n + 1) * (1 - UNDER_PREDICTION_RATE))
    ordered = sorted(residuals)
    if needed <= n:
        margin = ordered[needed - 1]
    else:
        enough = math.ceil(1 / UNDER_PREDICTION_RATE) - 1  # the n at which the quantile exists
        largest = max(ordered, default=0.0)
        margin = max(largest, 0.0) + DEFAULT_MARGIN * (1 - n / enough)
    return min(max(margin, 0.0), MAX_MARGIN)


def under_prediction_rate(pairs: Iterable[Pair], calibration: Calibration) -> float:
    """The share of (predicted, measured) runs that exceed their calibrated prediction."""
    clean = [(p, m) for p, m in pairs if p > 0 and m > 0]
    if not clean:
        return 0.0
    return sum(m > calibrated_bytes(p, calibration) for p, m in clean) / len(clean)
