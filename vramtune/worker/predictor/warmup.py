"""Warm the fake-tensor machinery once per process, so no trial's plan choice pays for it.

The first trace in a process costs about 2 s more than the next (torch imports and builds its
fake-tensor, decomposition and dispatch caches on first use, bench/results/predictor_profile.md;
10-15 s at load 5, issue 35). A worker warms it in a background thread as it starts, while it
registers, and waits for it before it leases its first trial (worker.loop.agent), so that no
trial's plan choice, nor its lease, pays for it; `predict` waits for it too. What to trace is
the caller's: the worker passes tiny configurations of its built-in tasks (worker.tasks.warm),
so the predictor never imports a task.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from vramtune.service.wire import Plan
from vramtune.worker.trial.runner import Config
from vramtune.worker.trial.task import Task

logger = logging.getLogger(__name__)

Workload = tuple[Task, Config]

_lock = threading.Lock()
_warmed = False
# Set as soon as a warm-up is asked for (before its thread runs, so that a wait that follows
# cannot slip through ahead of it), and once it has finished (or failed).
_asked = threading.Event()
_finished = threading.Event()
_POLL_S = 0.2  # how often a wait looks at its stop event


def warm_up(workloads: Sequence[Workload]) -> None:
    """Trace each workload once per process; later calls return at once (or wait for it)."""
    global _warmed
    _asked.set()
    with _lock:
        if _warmed:
            return
        _warmed = True
        from vramtune.worker.predictor.trace import CPU_TARGET, trace_training

        try:
            for task, config in workloads:
                trace_training(task, config, Plan(), CPU_TARGET)
        except Exception:  # a warm-up must never stop a worker; the first trace is just slower
            logger.warning("predictor warm-up failed", exc_info=True)
        finally:
            _finished.set()


def wait_for_warm_up(stop: threading.Event | None = None) -> bool:
    """Return once a warm-up asked for has finished (at once when none was asked for); False
    when `stop` was set first."""
    while _asked.is_set() and not _finished.wait(_POLL_S):
        if stop is not None and stop.is_set():
            return False
    return True


def warm_up_in_background(workloads: Sequence[Workload]) -> threading.Thread:
    """Start `warm_up` in a daemon thread (a no-op once warm)."""
    _asked.set()
    thread = threading.Thread(
        target=warm_up, args=(workloads,), name="predictor-warm-up", daemon=True
    )
    thread.start()
    return thread
