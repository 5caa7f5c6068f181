"""Plot series made small: downsampling that keeps what a reader looks for, exact fronts."""

from __future__ import annotations

from collections.abc import Sequence

MAX_POINTS = 2000


def best_so_far(values: Sequence[float], minimize: bool) -> list[tuple[int, float]]:
    """(index, best) where the running best improves, and at the last index: the exact line."""
    line: list[tuple[int, float]] = []
    for index, value in enumerate(values):
        if not line or (value < line[-1][1] if minimize else value > line[-1][1]):
            line.append((index, value))
    if line and line[-1][0] != len(values) - 1:
        line.append((len(values) - 1, line[-1][1]))
    return line


def extremes(values: Sequence[float], max_points: int = MAX_POINTS) -> list[int]:
    """Indices of at most ``max_points`` points: each bucket's first, lowest and highest.

    Outliers survive (a scatter's shape is its extremes) and the order stays that of the input.
    """
    n = len(values)
    if n <= max_points:
        return list(range(n))
    buckets = max(1, max_points // 3)
    size = n / buckets
    kept: list[int] = []
    for bucket in range(buckets):
        start, end = int(bucket * size), int((bucket + 1) * size)
        if start >= end:
            continue
        span = range(start, end)
        low = min(span, key=values.__getitem__)
        high = max(span, key=values.__getitem__)
        kept.extend(sorted({start, low, high}))
    return kept


def spread(n: int, max_points: int = MAX_POINTS, keep: Sequence[int] = ()) -> list[int]:
    """Sorted indices: all of ``keep`` and evenly spaced others, at most ``max_points`` in all.

    ``keep`` beyond ``max_points`` is itself thinned evenly.
    """
    kept = sorted(set(keep))
    if len(kept) >= max_points:
        return [kept[i] for i in _even(len(kept), max_points)]
    if n <= max_points:
        return list(range(n))
    chosen = set(kept)
    for index in _even(n, max_points - len(kept)):
        chosen.add(index)
    return sorted(chosen)


def _even(n: int, count: int) -> list[int]:
    """``count`` evenly spaced indices of range(n) (all of them when count >= n)."""
    if count >= n:
        return list(range(n))
    if count <= 0:
        return []
    step = n / count
    return sorted({int(i * step) for i in range(count)})


def pareto_front(costs: Sequence[float], values: Sequence[float], minimize: bool) -> list[int]:
    """Indices of the points no other beats on both a lower cost and a better value, by cost."""
    sign = 1.0 if minimize else -1.0
    order = sorted(range(len(costs)), key=lambda i: (costs[i], sign * values[i]))
    front: list[int] = []
    best: float | None = None
    for index in order:
        score = sign * values[index]
        if best is None or score < best:
            best = score
            front.append(index)
    return front


def quantile(sorted_values: Sequence[float], q: float) -> float | None:
    """The q-quantile of already sorted values (linear interpolation), None when empty."""
    if not sorted_values:
        return None
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)
