"""Where a prediction's time goes: building, tracing each step, the tracking mode, the profile.

For every zoo model (CPU shapes, the larger batch) and the demo's largest char-transformer, it
times a trace's parts (model + optimizer built under FakeTensorMode, step 1, step 2) with and
without the byte-counting mode, a one-step trace, and prints cProfile's top functions for the
char-transformer. Figures are printed; bench/results/predictor_profile.md says what they mean.

Usage: ``python bench/predictor_profile.py``
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.zoo import ZOO  # noqa: E402
from vramtune.service.wire import Plan  # noqa: E402
from vramtune.worker.device.memory import MemoryTracker  # noqa: E402
from vramtune.worker.predictor import CPU_TARGET, trace_training  # noqa: E402
from vramtune.worker.predictor.trace import _FakeDeepcopy, correct_fake  # noqa: E402
from vramtune.worker.tasks.charlm import CharTransformerTask  # noqa: E402
from vramtune.worker.trial.steps import build_for_plan, train_step  # noqa: E402
from vramtune.worker.trial.task import Task  # noqa: E402

CPU = torch.device("cpu")
DEMO_LARGEST = {"n_layers": 6, "d_model": 512, "n_heads": 8, "seq_len": 512, "dropout": 0.1}


def timed_parts(task: Task, config: dict[str, Any], tracked: bool, steps: int) -> dict[str, float]:
    """Seconds to build under fake mode and for each traced step."""
    times: dict[str, float] = {}
    started = time.perf_counter()
    with ExitStack() as stack:
        stack.enter_context(FakeTensorMode())
        stack.enter_context(_FakeDeepcopy())
        if tracked:
            stack.enter_context(MemoryTracker(device_type="cpu", correct=correct_fake))
        with CPU:
            model = build_for_plan(task, config, Plan(), CPU)
        optimizer = task.build_optimizer(model, config)
        times["build"] = time.perf_counter() - started
        batch = int(config[task.batch_size_param])
        for step in range(steps):
            began = time.perf_counter()
            train_step(
                task,
                model,
                optimizer,
                lambda n: task.example_batch(config, n, CPU),
                batch,
                Plan(),
                CPU,
            )
            times[f"step{step + 1}"] = time.perf_counter() - began
    times["total"] = time.perf_counter() - started
    return times


def main() -> None:
    """Print the timings and the profile."""
    cases: list[tuple[Task, dict[str, Any]]] = [
        (zoo, {**zoo.cpu, "batch_size": zoo.cpu_batches[1]}) for zoo in ZOO
    ]
    cases.append((CharTransformerTask(), {**DEMO_LARGEST, "batch_size": 64}))
    print("load", Path("/proc/loadavg").read_text().strip())
    for label in ("first trace in the process", "the same trace again"):
        began = time.perf_counter()
        trace_training(cases[0][0], cases[0][1], Plan(), CPU_TARGET)
        print(f"{label}: {time.perf_counter() - began:.3f} s")
    for task, config in cases:
        timed_parts(task, config, tracked=True, steps=2)  # first sight of its ops and shapes
        half = {**config, task.batch_size_param: int(config[task.batch_size_param]) // 2}
        rows = {
            "tracked": timed_parts(task, half, tracked=True, steps=2),
            "untracked": timed_parts(task, half, tracked=False, steps=2),
            "tracked 1 step": timed_parts(task, half, tracked=True, steps=1),
        }
        cells = "; ".join(
            f"{name} " + " ".join(f"{k}={v:.3f}" for k, v in row.items())
            for name, row in rows.items()
        )
        print(f"{task.name}: {cells}")
    profiler = cProfile.Profile()
    task, config = cases[-1]
    profiler.enable()
    timed_parts(task, config, tracked=True, steps=2)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    print(text.getvalue())
    print("load", Path("/proc/loadavg").read_text().strip())


if __name__ == "__main__":
    main()
