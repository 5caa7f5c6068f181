"""What fits on which card: how many configurations run as asked, resized by the old ladder,
resized only by the new rungs, or nowhere, on card sizes of 8, 16, 24, 48 and 80 GiB.

Predicted only (nothing runs): the worker's own plan choice (worker/plan/policy.py) on CUDA
cards, traced on fake cpu with CUDA's kernel choices emulated (a GPU worker traces on fake
cuda). Two ladders, both with the policy's 10 % margin:

- old: examples/hf-causal-lm.yaml's own `resizes` (micro_batch, checkpointing, bf16);
- new: micro_batch, selective_checkpointing, checkpointing, chunked_cross_entropy, bf16.

A configuration counts as "new rungs only" when the old ladder hands it back and the new one
runs it. Workloads: a seeded sample of examples/hf-causal-lm.yaml's search space (the whole
space is 3,402 configurations; a plan choice costs a few traces each, too many for this
2-core machine), and a 1B-parameter Llama-style config (Llama 3.2 1B's shapes: 16 layers,
width 2048, 32 heads / 8 KV heads, MLP 8192, vocabulary 128,256, tied embeddings) at 2,048
tokens, full training and LoRA r = 16, batch 1 and 8, built from its config, never downloaded.
The slowdown of each rung is the step-time model's prior (no fleet runs here): the median, over
the plans that used the rung, of the predicted time per step against as asked.

Writes ``what_fits.{md,json}`` under ``--out`` (default bench/results/), with the 1-minute load
average at the start and end of each workload.
Usage: ``flock /tmp/bench.lock python bench/what_fits.py [--sample 12]``
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import write_report  # noqa: E402
from common.plans import rungs_of  # noqa: E402
from service.wire import CardInfo, MemoryPolicy, Resize  # noqa: E402
from worker.plan.policy import RunAsPlanned, choose_plan, expected_slowdown  # noqa: E402
from worker.run.training import TorchTaskRunner  # noqa: E402
from worker.tasks.hf import HFCausalLMTask  # noqa: E402
from worker.trial.runner import CardSpec  # noqa: E402
from worker.trial.task import TaskConfigError  # noqa: E402

GIB = 1024**3
CARDS_GIB = [8, 16, 24, 48, 80]
# What a Hopper worker measures at start (FACTS.md): cuBLAS workspace per handle. The CUDA
# context (300-400 MiB) is outside torch's pool: a card's free memory is counted without it.
CONSTANTS = {"cublas_workspace_bytes": 32 * 1024**2}
CONTEXT_BYTES = 400 * 1024**2
OLD: list[Resize] = ["micro_batch", "checkpointing", "bf16"]
NEW: list[Resize] = [
    "micro_batch",
    "selective_checkpointing",
    "checkpointing",
    "chunked_cross_entropy",
    "bf16",
]
LLAMA_1B = {
    "model_type": "llama",
    "num_hidden_layers": 16,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "seq_len": 2048,
}
BATCHES_1B = (1, 8)
OUTCOMES = ["as asked", "old ladder", "new rungs only", "infeasible"]


def example_space() -> list[dict[str, Any]]:
    """Every configuration of examples/hf-causal-lm.yaml's search space that builds (lr aside:
    it does not change memory), with its task_config."""
    study = yaml.safe_load((REPO / "examples" / "hf-causal-lm.yaml").read_text())
    space = {k: v for k, v in study["search_space"].items() if v["type"] != "float"}
    axes = [_values(spec) for spec in space.values()]
    configs = []
    for values in itertools.product(*axes):
        config = {**study["task_config"], **dict(zip(space, values, strict=True))}
        if config["num_attention_heads"] % config["num_key_value_heads"] == 0:
            configs.append(config)
    return configs


def _values(spec: dict[str, Any]) -> list[Any]:
    if spec["type"] == "categorical":
        return list(spec["choices"])
    return list(range(spec["low"], spec["high"] + 1, spec.get("step", 1)))


def llama_1b() -> list[dict[str, Any]]:
    """The 1B config, full training and LoRA r = 16, at each of BATCHES_1B."""
    lora = {"finetune": {"method": "lora", "r": 16, "lora_alpha": 32}}
    return [
        {**LLAMA_1B, **tuning, "batch_size": batch} for tuning in ({}, lora) for batch in BATCHES_1B
    ]


def card(size_gib: int) -> tuple[CardSpec, int]:
    """A CUDA card of `size_gib` and its free bytes (less the CUDA context)."""
    total = size_gib * GIB
    info = CardInfo(model=f"cuda-{size_gib}GiB", total_bytes=total, free_bytes=total)
    return CardSpec(info=info, constants=dict(CONSTANTS), device="cuda:0"), total - CONTEXT_BYTES


def classify(runner: TorchTaskRunner, config: dict[str, Any], size_gib: int) -> dict[str, Any]:
    """One configuration on one card under both ladders: the outcome and the new plan's rungs."""
    spec, free = card(size_gib)
    old = choose_plan(runner, config, MemoryPolicy(resizes=OLD), spec, free)
    new = choose_plan(runner, config, MemoryPolicy(resizes=NEW), spec, free)
    if isinstance(old, RunAsPlanned):
        outcome = "as asked" if not rungs_of(old.plan) else "old ladder"
    else:
        outcome = "new rungs only" if isinstance(new, RunAsPlanned) else "infeasible"
    row: dict[str, Any] = {"card_gib": size_gib, "outcome": outcome, "new_rungs": []}
    if isinstance(new, RunAsPlanned):
        blocks = runner.checkpoint_block_count(config)
        row["new_rungs"] = rungs_of(new.plan)
        row["new_plan"] = new.plan.model_dump(exclude={"reason"})
        row["slowdown"] = expected_slowdown(new.plan, runner.batch_size(config), None, blocks)
    return row


def measure(name: str, configs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Every configuration on every card, with the load before and after and the seconds."""
    runner = TorchTaskRunner(HFCausalLMTask())
    load_start, started = os.getloadavg()[0], time.perf_counter()
    rows = []
    for config in configs:
        for size in CARDS_GIB:
            try:
                row = classify(runner, config, size)
            except TaskConfigError as error:
                row = {"card_gib": size, "outcome": "cannot build", "error": str(error)}
            rows.append({**row, "config": config})
    return {
        "workload": name,
        "rows": rows,
        "seconds": time.perf_counter() - started,
        "load_1min_start": load_start,
        "load_1min_end": os.getloadavg()[0],
    }


def counts(result: dict[str, Any]) -> dict[int, dict[str, int]]:
    """Per card size, how many configurations had each outcome."""
    table = {size: dict.fromkeys(OUTCOMES, 0) for size in CARDS_GIB}
    for row in result["rows"]:
        if row["outcome"] in OUTCOMES:
            table[row["card_gib"]][row["outcome"]] += 1
    return table


def slowdowns(results: list[dict[str, Any]]) -> dict[str, tuple[int, float]]:
    """Per rung, how many chosen plans used it and their median predicted slowdown."""
    by_rung: dict[str, list[float]] = {}
    for result in results:
        for row in result["rows"]:
            for rung in row.get("new_rungs", []):
                by_rung.setdefault(rung, []).append(row["slowdown"])
    return {rung: (len(v), statistics.median(v)) for rung, v in sorted(by_rung.items())}


def report(results: list[dict[str, Any]], sample: int, space_size: int) -> str:
    lines = [
        "# What fits: configurations per card size, old ladder against the new rungs",
        "",
        "Predicted only (`bench/what_fits.py`, the worker's own plan choice on CUDA cards traced",
        "on fake cpu with CUDA's kernels emulated; margin 10 %; the card's free memory is its",
        "size less a 400 MiB CUDA context). Old ladder: micro_batch, checkpointing, bf16 (the",
        "example's). New: micro_batch, selective_checkpointing, checkpointing,",
        "chunked_cross_entropy, bf16. 'new rungs only': the old ladder hands it back, the new",
        f"one runs it. The example's space has {space_size} configurations (lr aside); a seeded",
        f"sample of {sample} is classified (every plan choice costs a few traces).",
        "",
    ]
    for result in results:
        lines += [
            f"## {result['workload']}",
            "",
            f"{len(result['rows']) // len(CARDS_GIB)} configurations, "
            f"{result['seconds']:.0f} s, load (1 min) {result['load_1min_start']:.1f} at the "
            f"start, {result['load_1min_end']:.1f} at the end.",
            "",
            "| card | " + " | ".join(OUTCOMES) + " |",
            "|---|" + "---|" * len(OUTCOMES),
        ]
        for size, row in counts(result).items():
            lines.append(f"| {size} GiB | " + " | ".join(str(row[o]) for o in OUTCOMES) + " |")
        lines.append("")
    lines += [
        "## Predicted slowdown of each rung (the new ladder's chosen plans)",
        "",
        "Time per step against as asked, by the step-time model's prior (no fleet runs here;",
        "a fleet's fit replaces it): median over the plans that used the rung, which may use",
        "others too.",
        "",
        "| rung | plans | median slowdown |",
        "|---|---|---|",
    ]
    for rung, (n, median) in slowdowns(results).items():
        lines.append(f"| {rung} | {n} | {median:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=12, help="configurations of the space")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    space = example_space()
    sample = random.Random(args.seed).sample(space, min(args.sample, len(space)))
    results = [
        measure("examples/hf-causal-lm.yaml (sample)", sample),
        measure("Llama-style 1B at 2,048 tokens (full and LoRA r = 16)", llama_1b()),
    ]
    text = report(results, len(sample), len(space))
    write_report(args.out, "what_fits", {"results": results}, text)


if __name__ == "__main__":
    main()
