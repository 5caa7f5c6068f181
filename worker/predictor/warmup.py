"""Warm the fake-tensor machinery once per process, so no trial's plan choice pays for it.

The first trace in a process costs about 2 s more than the next (torch imports and builds its
fake-tensor, decomposition and dispatch caches on first use, bench/results/predictor_profile.md);
a worker warms it in a background thread as it starts, and `predict` waits for that to finish.
What to trace is the caller's: the worker passes tiny configurations of its built-in tasks
(worker.tasks.warm), so the predictor never imports a task.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from service.wire import Plan
from worker.trial.runner import Config
from worker.trial.task import Task

logger = logging.getLogger(__name__)

Workload = tuple[Task, Config]

_lock = threading.Lock()
_warmed = False


def warm_up(workloads: Sequence[Workload]) -> None:
    """Trace each workload once per process; later calls return at once (or wait for it)."""
    global _warmed
    with _lock:
        if _warmed:
            return
        _warmed = True
        from worker.predictor.trace import CPU_TARGET, trace_training

        try:
            for task, config in workloads:
                trace_training(task, config, Plan(), CPU_TARGET)
        except Exception:  # a warm-up must never stop a worker; the first trace is just slower
            logger.warning("predictor warm-up failed", exc_info=True)


def wait_for_warm_up() -> None:
    """Return once a warm-up in progress has finished (at once when none runs)."""
    with _lock:
        pass


def warm_up_in_background(workloads: Sequence[Workload]) -> threading.Thread:
    """Start `warm_up` in a daemon thread (a no-op once warm)."""
    thread = threading.Thread(
        target=warm_up, args=(workloads,), name="predictor-warm-up", daemon=True
    )
    thread.start()
    return thread
