"""The memory arithmetic both sides apply: the peak rule, and a served calibration applied to a
prediction (vramtune/service/calibration.py fits it; workers apply it before choosing a plan)."""

from __future__ import annotations

import math

from vramtune.service.wire import Calibration, Measured, Prediction


def held_peak(allocated: int, reserved: int | None) -> int:
    """The one rule from two peaks to the bytes a card had to hold, for measured and predicted
    peaks alike: what the caching allocator reserved when known, else what was allocated (the
    larger, should a counter lag the other)."""
    return max(reserved or 0, allocated)


def peak_of(peaks: Prediction | Measured) -> int:
    """The bytes a card must hold for a predicted or measured run (`held_peak`)."""
    return held_peak(peaks.peak_allocated_bytes, peaks.peak_reserved_bytes)


# How a worker applies the Calibration it is served; the raw peaks ride in Prediction.constants
# under these keys, so that the server fits on what the predictor said before any correction.
RAW_ALLOCATED = "uncalibrated_allocated_bytes"
RAW_RESERVED = "uncalibrated_reserved_bytes"


def calibrated_bytes(predicted: int, calibration: Calibration) -> int:
    """`predicted` after the correction and the margin (never negative)."""
    line = calibration.scale * predicted + calibration.offset_bytes
    return max(math.ceil(line * (1 + calibration.margin_fraction)), 0)


def raw_peaks(prediction: Prediction) -> tuple[int, int]:
    """(allocated, reserved) as predicted before any calibration: what a fit must be fed."""
    return (
        prediction.constants.get(RAW_ALLOCATED, prediction.peak_allocated_bytes),
        prediction.constants.get(RAW_RESERVED, prediction.peak_reserved_bytes),
    )


def apply_calibration(prediction: Prediction, calibration: Calibration) -> Prediction:
    """The prediction corrected by `calibration`; the raw peaks stay in `constants`.

    Applying it again starts from the raw peaks, so calibration never compounds.
    """
    allocated, reserved = raw_peaks(prediction)
    return prediction.model_copy(
        update={
            "peak_allocated_bytes": calibrated_bytes(allocated, calibration),
            "peak_reserved_bytes": calibrated_bytes(reserved, calibration),
            "constants": {**prediction.constants, RAW_ALLOCATED: allocated, RAW_RESERVED: reserved},
        }
    )
