"""What the offload rungs take off a CUDA card, predicted: GPT-2 small and a Llama-style decoder
(hf-causal-lm) as asked, checkpointed, with each offload and with both, and the step-time
model's prior slowdown of each.

Predicted only, on the trace a CUDA card gets on a machine without one (fake cpu emulating the
card, the host copies on meta, which the tracker does not count); a worker with a GPU traces on
fake cuda instead, and bench/gpu_offload.py compares that with the card's
`max_memory_allocated`. Writes ``offload_savings.{md,json}`` under ``--out`` (default
bench/results/) with the 1-minute load average.
Usage: ``flock /tmp/bench.lock python bench/offload_savings.py``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import write_report  # noqa: E402
from vramtune.common.step_time import default_step_time_fit, step_time_slowdown  # noqa: E402
from vramtune.service.wire import CardInfo, Plan  # noqa: E402
from vramtune.worker.plan.policy import step_features  # noqa: E402
from vramtune.worker.predictor import clear_cache, predict  # noqa: E402
from vramtune.worker.tasks.hf import HFCausalLMTask  # noqa: E402
from vramtune.worker.trial.runner import CardSpec  # noqa: E402
from vramtune.worker.trial.task import Config  # noqa: E402

CARD = CardSpec(
    info=CardInfo(model="emulated CUDA", total_bytes=80 * 2**30, free_bytes=80 * 2**30),
    device="cuda",
)
PLANS = {
    "as asked": Plan(),
    "checkpointing": Plan(checkpointing=True),
    "activation_offload": Plan(activation_offload=True),
    "optimizer_offload": Plan(optimizer_offload=True),
    "both offloads": Plan(activation_offload=True, optimizer_offload=True),
}
CONFIGS: dict[str, Config] = {
    "GPT-2 small, 8 × 512 tokens": {
        "model_type": "gpt2",
        "num_hidden_layers": 12,
        "hidden_size": 768,
        "num_attention_heads": 12,
        "vocab_size": 50257,
        "seq_len": 512,
        "batch_size": 8,
        "lr": 1e-4,
    },
    "Llama-style 8 × 1024, d 1024, 8 layers": {
        "model_type": "llama",
        "num_hidden_layers": 8,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "vocab_size": 32000,
        "seq_len": 1024,
        "batch_size": 8,
        "lr": 1e-4,
    },
}


def one_row(name: str, config: Config, plan_name: str, plan: Plan) -> dict[str, Any]:
    """One plan's predicted peak and breakdown on the emulated card."""
    clear_cache()
    started = time.perf_counter()
    prediction = predict(HFCausalLMTask(), config, plan, CARD)
    fit = default_step_time_fit()
    return {
        "config": name,
        "plan": plan_name,
        "method": prediction.method,
        "reason": prediction.reason,
        "peak_allocated": prediction.peak_allocated_bytes,
        "breakdown": prediction.breakdown,
        "prior_slowdown": step_time_slowdown(fit, step_features(plan, config["batch_size"])),
        "seconds": time.perf_counter() - started,
        "load": os.getloadavg()[0],
    }


def render(rows: list[dict[str, Any]]) -> str:
    """One table: each configuration's plans, peak and its parts in MiB."""
    lines = [
        "# What the offload rungs take off a CUDA card (predicted)",
        "",
        "The trace a CUDA card gets on a machine without one (fake cpu emulating the card, host "
        "copies on meta, not counted). MiB; prior: the step-time model's slowdown before any "
        "run. Produced by `bench/offload_savings.py`.",
        "",
        "| configuration | plan | peak | parameters | activations | optimizer state | gradients | "
        "temporaries | prior slowdown | trace s | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        part = row["breakdown"]

        def mib(n: int) -> str:
            return f"{n / 2**20:,.1f}"

        lines.append(
            f"| {row['config']} | {row['plan']} | {mib(row['peak_allocated'])} | "
            f"{mib(part.get('parameters', 0))} | {mib(part.get('activations', 0))} | "
            f"{mib(part.get('optimizer_state', 0))} | "
            f"{mib(part.get('gradients', 0))} | {mib(part.get('temporaries', 0))} | "
            f"{row['prior_slowdown']:.2f}x | {row['seconds']:.1f} | {row['load']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    rows = [
        one_row(name, config, plan_name, plan)
        for name, config in CONFIGS.items()
        for plan_name, plan in PLANS.items()
    ]
    write_report(args.out, "offload_savings", {"rows": rows}, render(rows))


if __name__ == "__main__":
    main()
