"""Calibration math: the fitted correction, the margin's under-prediction bound, applying it."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from vramtune.common.memory import RAW_RESERVED, apply_calibration, calibrated_bytes, raw_peaks
from vramtune.service.calibration import DEFAULT_MARGIN, fit_calibration, under_prediction_rate
from vramtune.service.wire import Calibration, Prediction

MiB = 2**20


def _runs(n: int, seed: int, scale: float, offset: int, noise: float) -> list[tuple[int, int]]:
    """(predicted, measured): measured = scale * predicted + offset, times lognormal noise."""
    rng = random.Random(seed)
    runs = []
    for _ in range(n):
        predicted = rng.randint(200, 20_000) * MiB
        measured = (scale * predicted + offset) * rng.lognormvariate(0.0, noise)
        runs.append((predicted, round(measured)))
    return runs


def test_no_history_is_the_identity_with_the_default_margin() -> None:
    calibration = fit_calibration("NVIDIA H200", "2.13.0", "digits-mlp", [])
    assert (calibration.scale, calibration.offset_bytes) == (1.0, 0)
    assert calibration.margin_fraction == DEFAULT_MARGIN
    assert calibration.n_observations == 0
    assert (calibration.card_model, calibration.torch_version, calibration.task) == (
        "NVIDIA H200",
        "2.13.0",
        "digits-mlp",
    )


def test_a_few_runs_fit_an_offset_and_a_margin_above_every_residual() -> None:
    pairs = [(1000 * MiB, 1100 * MiB), (2000 * MiB, 2150 * MiB), (1500 * MiB, 1680 * MiB)]
    calibration = fit_calibration("card", "2.13.0", "task", pairs)
    assert calibration.scale == 1.0
    assert calibration.offset_bytes == 150 * MiB  # the median miss
    assert under_prediction_rate(pairs, calibration) == 0.0
    assert calibration.margin_fraction > 0.02  # few runs: part of the default still held back


def test_a_constant_miss_on_small_runs_is_not_a_scale_on_a_large_one() -> None:
    """Issue 29: three small runs measured 2.7-4.6x their prediction (an unpredicted
    evaluation of a fixed size); a 40 MiB prediction must stay near 40 MiB, not x3.6."""
    overhead = 70 * 1024
    pairs = [(p, p + overhead) for p in (26 * 1024, 30 * 1024, 40 * 1024)]
    calibration = fit_calibration("card", "2.13.0", "task", pairs)
    assert calibration.scale == 1.0 and calibration.offset_bytes == overhead
    assert under_prediction_rate(pairs, calibration) == 0.0
    large = calibrated_bytes(40 * MiB, calibration)
    assert 40 * MiB + overhead <= large < 1.1 * 40 * MiB


def test_many_runs_recover_scale_and_offset_and_bound_under_predictions() -> None:
    history = _runs(600, seed=1, scale=1.08, offset=400 * MiB, noise=0.02)
    calibration = fit_calibration("card", "2.13.0", "task", history)
    assert calibration.scale == pytest.approx(1.08, abs=0.02)
    assert calibration.offset_bytes == pytest.approx(400 * MiB, abs=60 * MiB)
    assert under_prediction_rate(history, calibration) <= 0.01
    fresh = _runs(2000, seed=2, scale=1.08, offset=400 * MiB, noise=0.02)
    assert under_prediction_rate(fresh, calibration) <= 0.02
    assert calibration.margin_fraction < 0.1  # tight: the noise is 2 %


def test_outliers_do_not_move_the_line() -> None:
    history = _runs(300, seed=3, scale=1.0, offset=0, noise=0.01)
    spiked = [(p, m * 3) if i % 20 == 0 else (p, m) for i, (p, m) in enumerate(history)]
    calibration = fit_calibration("card", "2.13.0", "task", spiked)
    assert calibration.scale == pytest.approx(1.0, abs=0.03)
    assert under_prediction_rate(spiked, calibration) <= 0.05  # the spikes exceed the margin cap


def test_equal_predictions_fit_a_ratio_and_bad_pairs_are_ignored() -> None:
    pairs = [(1000, 1200)] * 50 + [(0, 5), (100, 0), (-1, 10)]
    calibration = fit_calibration("card", "2.13.0", "task", pairs)
    assert calibration.n_observations == 50
    assert calibration.scale == pytest.approx(1.2)
    assert calibrated_bytes(1000, calibration) >= 1200


def test_apply_corrects_both_peaks_keeps_the_raw_ones_and_never_compounds() -> None:
    calibration = Calibration(
        card_model="card",
        torch_version="2.13.0",
        task="task",
        scale=1.1,
        offset_bytes=100,
        margin_fraction=0.1,
    )
    raw = Prediction(peak_allocated_bytes=1000, peak_reserved_bytes=2000, constants={"x": 5})
    once = apply_calibration(raw, calibration)
    assert once.peak_allocated_bytes == 1320  # (1.1 * 1000 + 100) * 1.1
    assert once.peak_reserved_bytes == 2530
    assert once.constants["x"] == 5 and once.constants[RAW_RESERVED] == 2000
    assert raw_peaks(once) == (1000, 2000)
    assert apply_calibration(once, calibration) == once


def test_the_server_can_import_it_without_torch() -> None:
    code = "import sys, vramtune.service.calibration; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
