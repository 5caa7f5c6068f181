"""What the optimizer rungs (adamw_8bit, adafactor; worker/trial/optimizers.py) cost and save on
the CPU card: seconds per optimizer step and the optimizer state, against the task's AdamW.

Each configuration runs `STEPS` real training steps (after one warm-up step) per plan under the
memory tracker, as the CPU card's trainer does (so torchao's update runs eagerly, as there),
and is predicted by the trace: the table gives the measured and predicted peaks, the optimizer
state at the peak, and the median step time relative to AdamW's. The step-time model's priors
for the two rungs (vramtune/common/step_time.py) are read from these ratios. Writes
``optimizer_rungs.{md,json}`` under ``--out`` (default bench/results/) with the 1-minute load
average beside each figure.
Usage: ``flock /tmp/bench.lock python bench/optimizer_rungs.py``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vramtune.common.memory import peak_of  # noqa: E402
from vramtune.service.wire import Plan  # noqa: E402
from vramtune.worker.device.memory import MemoryTracker  # noqa: E402
from vramtune.worker.predictor import clear_cache, predict  # noqa: E402
from vramtune.worker.tasks.charlm import CharTransformerTask  # noqa: E402
from vramtune.worker.trial.steps import (  # noqa: E402
    batch_feeder,
    build_for_plan,
    build_optimizer_for_plan,
    train_step,
)
from vramtune.worker.trial.task import Task  # noqa: E402

STEPS = 5
CONFIGS: dict[str, dict[str, Any]] = {
    "char 2×64, batch 1 (state-bound)": {
        "n_layers": 2,
        "d_model": 64,
        "n_heads": 4,
        "seq_len": 8,
        "batch_size": 1,
    },
    "char 4×256, batch 16 × 128": {
        "n_layers": 4,
        "d_model": 256,
        "n_heads": 8,
        "seq_len": 128,
        "batch_size": 16,
    },
}
PLANS = {
    "AdamW (as asked)": Plan(),
    "adamw_8bit": Plan(optimizer="adamw_8bit"),
    "adafactor": Plan(optimizer="adafactor"),
}


def load() -> float:
    return os.getloadavg()[0]


def measure(task: Task, config: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Median seconds per step and the tracker's peak and optimizer state, as the CPU card runs."""
    batch = int(config["batch_size"])
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    tracker = MemoryTracker(device_type="cpu")
    seconds = []
    with tracker:
        model = build_for_plan(task, config, plan, cpu)
        optimizer = build_optimizer_for_plan(task, model, config, plan)
        next_batch = batch_feeder(task.batches(config, batch, cpu, seed=0))
        loss = None  # kept alive into the next step, as the trainer keeps it
        for step in range(STEPS + 1):
            started = time.perf_counter()
            loss = train_step(task, model, optimizer, next_batch, batch, plan, cpu)
            tracker.label_training_state(model, optimizer)
            if step:  # the first step builds the state
                seconds.append(time.perf_counter() - started)
        del loss
    return {
        "step_s": statistics.median(seconds),
        "measured_peak": tracker.peak_bytes,
        "optimizer_state": tracker.breakdown()["optimizer_state"],
        "load": load(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    task = CharTransformerTask()
    rows = []
    for name, config in CONFIGS.items():
        base = None
        for label, plan in PLANS.items():
            clear_cache()
            predicted = peak_of(predict(task, config, plan))
            row = {
                "config": name,
                "plan": label,
                "predicted_peak": predicted,
                **measure(task, config, plan),
            }
            base = base or row
            row["step_ratio"] = row["step_s"] / base["step_s"]
            row["state_ratio"] = row["optimizer_state"] / base["optimizer_state"]
            rows.append(row)
            print(row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optimizer_rungs.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "# Optimizer rungs on the CPU card: step time and state against AdamW",
        "",
        f"`bench/optimizer_rungs.py`, {STEPS} steps after a warm-up, median; torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs shared with other work.",
        "",
        "| configuration | plan | predicted peak | measured peak | optimizer state | state / AdamW "
        "| s per step | step / AdamW | load (1 min) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['config']} | {r['plan']} | {r['predicted_peak']:,} | {r['measured_peak']:,} | "
        f"{r['optimizer_state']:,} | {r['state_ratio']:.2f} | {r['step_s']:.3f} | "
        f"{r['step_ratio']:.2f} | {r['load']:.1f} |"
        for r in rows
    ]
    (args.out / "optimizer_rungs.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
