"""LoRA and models that do not build under fake tensors: the trace after conversion against the
real CPU run, beside the probe that predicted them before.

Cases: hf-causal-lm with LoRA (r = 8 and 64) on a small Llama-style and a small GPT-2 config,
as asked and with checkpointing, on a float base and on a base quantized by torchao (QLoRA:
`quantized_base` int8 and nf4, both of which run on the CPU); and a model of our own whose
build calls `torch.unique` and `.item()` (as timm's RegNet and DeiT do; timm needs
torchvision, which would replace this machine's CPU torch). For each: the traced prediction,
the probe's (the fallback these took before: two real steps at a quarter and a half of the
batch, extrapolated; not run for the quantized bases, which never took it) and the real CPU
run's tracked peak over two steps, with each one's wall time and the 1-minute load average.

Writes ``lora_prediction.{md,json}`` under ``--out`` (default bench/results/).
Usage: ``flock /tmp/vramtune-bench.lock python bench/lora_prediction.py``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "worker"))

from bench.report import write_report  # noqa: E402
from vramtune.service.wire import Plan  # noqa: E402
from vramtune.worker.device.memory import MemoryTracker  # noqa: E402
from vramtune.worker.predictor import clear_cache, predict  # noqa: E402
from vramtune.worker.predictor.core import _probe  # noqa: E402
from vramtune.worker.trial.steps import batch_feeder, build_for_plan, train_step  # noqa: E402
from vramtune.worker.trial.task import Config, Task  # noqa: E402

CPU = torch.device("cpu")
BASE = {
    "num_hidden_layers": 4,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "intermediate_size": 512,
    "seq_len": 128,
    "batch_size": 8,
    "corpus_chars": 50_000,
    "eval_windows": 4,
}
QUANTIZED_BASES = ("none", "int8", "nf4")
"""The frozen base: float, or quantized by torchao (both kinds run on the CPU)."""
FAMILIES = {
    "llama (GQA 4/2)": {**BASE, "model_type": "llama", "num_key_value_heads": 2},
    "gpt2 (dropout 0.1)": {**BASE, "model_type": "gpt2", "dropout": 0.1},
}


def real_peak(task: Task, config: Config, plan: Plan) -> int:
    """Two real training steps through the trainer's step, tracked (the simulated card)."""
    batch = int(config[task.batch_size_param])
    batches = task.batches(config, plan.micro_batch or batch, CPU, seed=0)
    tracker = MemoryTracker(device_type="cpu")
    with tracker:
        model = build_for_plan(task, config, plan, CPU)
        optimizer = task.build_optimizer(model, config)
        next_batch = batch_feeder(batches)
        for _ in range(2):
            loss = train_step(task, model, optimizer, next_batch, batch, plan, CPU)
        del loss
    return tracker.peak_bytes


def timed(run: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    value = run()
    return value, time.perf_counter() - started


def case(name: str, task: Task, config: Config, plan: Plan, probe: bool = True) -> dict[str, Any]:
    clear_cache()
    traced, trace_s = timed(lambda: predict(task, config, plan))
    probed, probe_s = None, None
    if probe:
        clear_cache()
        probed, probe_s = timed(
            lambda: _probe(task, config, plan, None, "bench", time.perf_counter())
        )
    real, real_s = timed(lambda: real_peak(task, config, plan))
    row = {
        "case": name,
        "quantized_base": config.get("quantized_base", "none"),
        "plan": "checkpointing" if plan.checkpointing else "as asked",
        "method": traced.method,
        "predicted": traced.peak_allocated_bytes,
        "probe": None if probed is None else probed.peak_allocated_bytes,
        "real": real,
        "trace_error_pct": 100 * (traced.peak_allocated_bytes - real) / real,
        "probe_error_pct": None
        if probed is None
        else 100 * (probed.peak_allocated_bytes - real) / real,
        "trace_s": trace_s,
        "probe_s": probe_s,
        "real_s": real_s,
        "load_1min": os.getloadavg()[0],
    }
    print(row, flush=True)
    return row


def rows() -> list[dict[str, Any]]:
    from test_predictor_conversion import StagewiseTask

    from vramtune.worker.tasks.hf import HFCausalLMTask

    hf = HFCausalLMTask()
    out = []
    for quantized in QUANTIZED_BASES:
        for family, base in FAMILIES.items():
            for r in (8, 64):
                lora = {"method": "lora", "r": r, "lora_dropout": 0.05}
                config = {**base, "finetune": lora, "quantized_base": quantized}
                name = f"{family}, {'Q' if quantized != 'none' else ''}LoRA r={r}"
                for plan in (Plan(), Plan(checkpointing=True)):
                    out.append(case(name, hf, config, plan, probe=quantized == "none"))
    stagewise = {"width": 256, "batch_size": 32}
    for plan in (Plan(), Plan(checkpointing=True)):
        out.append(
            case("own model: unique + .item() while building", StagewiseTask(), stagewise, plan)
        )
    return out


def report(result: list[dict[str, Any]]) -> str:
    lines = [
        "# LoRA and models built outside the fake mode: predicted vs the real CPU run",
        "",
        "`python bench/lora_prediction.py` (torch "
        f"{torch.__version__}, CPU, simulated card). Bytes are the tracked peak of two training "
        "steps. *trace*: the prediction now (built on meta or for real, converted to fake "
        "tensors; a quantized weight through its own flatten/unflatten, so it keeps its packed "
        "storage); *probe*: the fallback the float-base models took before (two real steps at "
        "a quarter and a half of the batch, extrapolated; not run for the quantized bases). "
        "Configs: 4 layers, d 128, MLP 512, 128 tokens, batch 8, LoRA dropout 0.05, peft's "
        "default target modules. *base*: the frozen base's linear layers (all but the output "
        "layer) in float, or quantized by torchao before peft wraps them: int8 weight-only "
        "(`Int8WeightOnlyConfig`) or nf4 (`to_nf4`, QLoRA's 4-bit NormalFloat).",
        "",
        "| case | base | plan | method | real (B) | trace (B) | trace error | probe error | "
        "trace s | probe s | real 2 steps s | load 1 min |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result:
        probe_error = "—" if row["probe"] is None else f"{row['probe_error_pct']:+.2f} %"
        probe_s = "—" if row["probe_s"] is None else f"{row['probe_s']:.2f}"
        lines.append(
            f"| {row['case']} | {row['quantized_base']} | {row['plan']} | {row['method']} | "
            f"{row['real']:,} | {row['predicted']:,} | {row['trace_error_pct']:+.4f} % | "
            f"{probe_error} | {row['trace_s']:.2f} | {probe_s} | "
            f"{row['real_s']:.2f} | {row['load_1min']:.1f} |"
        )
    exact = sum(row["predicted"] == row["real"] for row in result)
    lines += [
        "",
        f"Exact to the byte: {exact} of {len(result)} cases. Every case ran for real on the CPU "
        "(none is predicted only: torchao's int8 and nf4 kernels both run on the CPU; int4, "
        "which needs CUDA, is not offered). The first row's trace time includes the process's "
        "first trace (torch's fake-tensor warm-up, importing transformers and peft), which a "
        "worker pays in its start-up warm-up. The own model stands in for timm's RegNet and DeiT "
        "(timm needs torchvision, which would replace this machine's CPU torch); its build "
        "fails on meta too (`.item()` has no value there), so it is built for real and "
        "converted. Times are wall seconds on a shared 2-core machine; compare within a row.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    result = rows()
    write_report(args.out, "lora_prediction", {"rows": result}, report(result))


if __name__ == "__main__":
    main()
