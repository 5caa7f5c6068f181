"""Warm the fake-tensor machinery once per process, so no trial's plan choice pays for it.

The first trace in a process costs about 2 s more than the next (torch imports and builds its
fake-tensor, decomposition and dispatch caches on first use, bench/results/predictor_profile.md);
a worker warms it in a background thread as it starts, and `predict` waits for that to finish.
"""

from __future__ import annotations

import logging
import threading

from service.wire import Plan

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_warmed = False
# Tiny configurations of the built-in tasks: attention, layer norm, embeddings, convolutions,
# group norm, pooling, cross-entropy and foreach AdamW are the ops most models start with.
_TINY_GPT = {"n_layers": 1, "d_model": 16, "n_heads": 2, "seq_len": 8, "batch_size": 2}
_TINY_CNN = {"width": 4, "depth": 2, "resolution": 8, "batch_size": 2}


def warm_up() -> None:
    """Trace two tiny models once per process; later calls return at once (or wait for it)."""
    global _warmed
    with _lock:
        if _warmed:
            return
        _warmed = True
        from worker.predictor.trace import CPU_TARGET, trace_training
        from worker.tasks.charlm import CharTransformerTask
        from worker.tasks.digits import DigitsCNNTask

        try:
            trace_training(CharTransformerTask(), _TINY_GPT, Plan(), CPU_TARGET)
            trace_training(DigitsCNNTask(), _TINY_CNN, Plan(), CPU_TARGET)
        except Exception:  # a warm-up must never stop a worker; the first trace is just slower
            logger.warning("predictor warm-up failed", exc_info=True)


def warm_up_in_background() -> threading.Thread:
    """Start `warm_up` in a daemon thread (a no-op once warm)."""
    thread = threading.Thread(target=warm_up, name="predictor-warm-up", daemon=True)
    thread.start()
    return thread
