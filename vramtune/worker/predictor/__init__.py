"""Peak-memory prediction: trace a training step under FakeTensorMode (DESIGN.md section 3).

Public API:
    predict(task, config, plan, card=None) -> Prediction
    largest_micro_batch(task, config, plan, budget_bytes, card=None) -> (micro, Prediction) | None
    measure_card_constants(device) -> CardConstants
    footprint(prediction) -> int: the bytes a card must hold (reserved, or allocated if larger)
    phase_peaks(task, config, plan, card=None) -> dict: each phase's peak of the last predict
    clear_cache(): forget cached predictions and probes
    warm_up(workloads) / warm_up_in_background(workloads): pay the first trace's one-time cost
    wait_for_warm_up(stop=None) -> bool: return once a warm-up asked for has finished
"""

from vramtune.worker.predictor.card import measure_card_constants
from vramtune.worker.predictor.core import (
    card_constants,
    clear_cache,
    footprint,
    from_trace,
    largest_micro_batch,
    phase_peaks,
    predict,
)
from vramtune.worker.predictor.trace import (
    CPU_TARGET,
    EMULATED_CUDA_TARGET,
    CannotTrace,
    Target,
    target_for,
    trace_training,
)
from vramtune.worker.predictor.warmup import wait_for_warm_up, warm_up, warm_up_in_background

__all__ = [
    "CPU_TARGET",
    "EMULATED_CUDA_TARGET",
    "CannotTrace",
    "Target",
    "card_constants",
    "clear_cache",
    "footprint",
    "from_trace",
    "largest_micro_batch",
    "measure_card_constants",
    "phase_peaks",
    "predict",
    "target_for",
    "trace_training",
    "wait_for_warm_up",
    "warm_up",
    "warm_up_in_background",
]
