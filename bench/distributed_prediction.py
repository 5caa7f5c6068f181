"""Per-rank prediction of data-parallel trials against real gloo ranks (issue 31).

Every rank of DDP and FSDP2 is traced on PyTorch's fake process group
(`worker.predictor.distributed.trace_rank(..., rank=r)`) and compared with the tracked peak of
that rank in a real run on W spawned CPU processes over gloo (`measure_rank_peaks`), at world
sizes 2 and 4,
for hf-causal-lm (a tiny Llama from its config, one `fully_shard` per decoder layer then the
root) and digits-cnn (its conv stages sharded, then the root), two global batch sizes, with and
without activation checkpointing, one or two micro-batches per rank; FSDP2 both ways: resharding
each unit's parameters after forward (its default) and keeping them gathered until backward
(`reshard_after_forward=False`, the plan ladder's faster FSDP2 rung).
Target: within 0.1 % on every rank of every case.

Then the prediction's cost: wall and CPU seconds of a trace at world sizes 2 to 64 (hf-causal-lm,
both strategies), beside one real step of the same configuration on 2 gloo ranks, and the cost
of isolating a trace in a fresh subprocess (what it would take if the fake group could not be
torn down in-process; it can, tested in tests/worker/test_distributed_prediction.py).

Run it alone on the machine:
``flock /tmp/bench.lock .venv/bin/python bench/distributed_prediction.py``
Writes ``distributed_prediction.{md,json}`` under ``--out`` (default bench/results/).
``--only-gathered`` measures only the cases keeping FSDP2's parameters gathered and merges them
into the results already there (their other rows and timings kept, with their own dates).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import write_report  # noqa: E402
from vramtune.service.wire import Plan  # noqa: E402
from vramtune.worker.predictor.distributed import (  # noqa: E402
    STRATEGIES,
    RankRun,
    Strategy,
    measure_rank_peaks,
    trace_rank,
)
from vramtune.worker.tasks.digits import DigitsCNNTask  # noqa: E402
from vramtune.worker.tasks.hf import HFCausalLMTask  # noqa: E402
from vramtune.worker.trial.steps import micro_batch_sizes  # noqa: E402
from vramtune.worker.trial.task import Config, Task  # noqa: E402

TOLERANCE = 0.001
HF_MODEL: Config = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_len": 64,
}
CNN_MODEL: Config = {"width": 16, "depth": 3, "resolution": 32}
FAMILIES: list[tuple[Task, Config, tuple[int, int]]] = [
    (HFCausalLMTask(), HF_MODEL, (8, 16)),
    (DigitsCNNTask(), CNN_MODEL, (16, 32)),
]
ACCUMULATIONS = (1, 2)
"""Micro-batches per rank: the per-rank micro-batch is global batch / (W x accumulation)."""
SCALING_WORLD_SIZES = (2, 4, 8, 16, 32, 64)
SCALING_CONFIG: Config = {**HF_MODEL, "batch_size": 64}


def load_average() -> float:
    """The 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def accuracy_runs(world_size: int, gathered: bool = False) -> list[RankRun]:
    """Every family x strategy x batch x checkpointing x accumulation (1 or 2) case;
    `gathered`: the FSDP2 cases keeping parameters gathered after forward instead."""
    wrappers: list[tuple[Strategy, bool]] = (
        [("fsdp", False)] if gathered else [(strategy, True) for strategy in STRATEGIES]
    )
    return [
        RankRun(
            task,
            {**model, "batch_size": batch},
            Plan(
                checkpointing=checkpointing,
                micro_batch=batch // (world_size * accumulation) if accumulation > 1 else None,
                world_size=world_size,
                strategy=strategy,
                reshard_after_forward=reshard,
            ),
            strategy,
        )
        for task, model, batches in FAMILIES
        for strategy, reshard in wrappers
        for batch in batches
        for checkpointing in (False, True)
        for accumulation in ACCUMULATIONS
    ]


def accumulation_of(run: RankRun, world_size: int) -> int:
    """How many micro-batches each rank runs a step."""
    return len(micro_batch_sizes(int(run.config["batch_size"]) // world_size, run.plan))


def accuracy(world_size: int, gathered: bool = False) -> list[dict[str, Any]]:
    """Predicted vs measured peak of every rank of every case at `world_size`."""
    runs = accuracy_runs(world_size, gathered)
    load_before = load_average()
    started = time.perf_counter()
    measured = measure_rank_peaks(runs, world_size)
    real_seconds = time.perf_counter() - started
    print(f"W={world_size}: {len(runs)} real runs in {real_seconds:.0f} s", flush=True)
    rows = []
    for run, measurement in zip(runs, measured, strict=True):
        predictions = [
            trace_rank(run.task, run.config, run.plan, run.strategy, world_size, rank)
            for rank in range(world_size)
        ]
        predicted, real = predictions[0], measurement.peaks[0]
        rows.append(
            {
                "task": run.task.name,
                "world_size": world_size,
                "strategy": run.strategy,
                "reshard_after_forward": run.plan.reshard_after_forward,
                "global_batch": run.config["batch_size"],
                "checkpointing": run.plan.checkpointing,
                "accumulation": accumulation_of(run, world_size),
                "predicted_allocated": predicted.allocated_bytes,
                "predicted_reserved": predicted.reserved_bytes,
                "measured_rank0": real,
                "measured_all_ranks": measurement.peaks,
                "predicted_all_ranks": [p.allocated_bytes for p in predictions],
                "error": (predicted.allocated_bytes - real) / real,
                "worst_rank_error": max(
                    (
                        abs(p.allocated_bytes - m) / m
                        for p, m in zip(predictions, measurement.peaks, strict=True)
                    ),
                ),
                "trace_seconds": predicted.seconds,
                "load_1min": load_before,
            }
        )
    return rows


def trace_timing(strategy: Strategy, world_size: int, repeats: int = 3) -> dict[str, Any]:
    """Median wall and CPU seconds of a trace (the first, paying one-time costs, apart)."""
    walls, cpus = [], []
    for _ in range(repeats):
        cpu = time.process_time()
        prediction = trace_rank(HFCausalLMTask(), SCALING_CONFIG, Plan(), strategy, world_size)
        walls.append(prediction.seconds)
        cpus.append(time.process_time() - cpu)
    return {
        "strategy": strategy,
        "world_size": world_size,
        "wall_seconds": statistics.median(walls),
        "cpu_seconds": statistics.median(cpus),
        "allocated": prediction.allocated_bytes,
        "load_1min": load_average(),
    }


def real_step_seconds() -> dict[str, Any]:
    """One real steady-state step (step 2, rank 0) of the scaling configuration on 2 ranks."""
    runs = [RankRun(HFCausalLMTask(), SCALING_CONFIG, Plan(), s) for s in STRATEGIES]
    load = load_average()
    measured = measure_rank_peaks(runs, 2)
    return {
        strategy: {"step_seconds": m.step_seconds[-1], "load_1min": load}
        for strategy, m in zip(STRATEGIES, measured, strict=True)
    }


def subprocess_cost() -> dict[str, float]:
    """Wall seconds of one trace in a fresh interpreter (imports included) vs in-process."""
    code = (
        "from vramtune.service.wire import Plan\n"
        "from vramtune.worker.predictor.distributed import trace_rank\n"
        "from vramtune.worker.tasks.hf import HFCausalLMTask\n"
        f"trace_rank(HFCausalLMTask(), {SCALING_CONFIG!r}, Plan(), 'fsdp', 8)\n"
    )
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    fresh = time.perf_counter() - started
    in_process = trace_timing("fsdp", 8, repeats=1)["wall_seconds"]
    return {
        "subprocess_seconds": fresh,
        "in_process_seconds": in_process,
        "load_1min": load_average(),
    }


def render(result: dict[str, Any]) -> str:
    rows = result["accuracy"]
    worst = max(r["worst_rank_error"] for r in rows)
    misses = [r for r in rows if r["worst_rank_error"] > TOLERANCE]
    ranks = sum(r["world_size"] for r in rows)
    rank_misses = sum(
        abs(p - m) > TOLERANCE * m
        for r in rows
        for p, m in zip(r["predicted_all_ranks"], r["measured_all_ranks"], strict=True)
    )
    lines = [
        "# Per-rank prediction of DDP and FSDP2 trials vs real gloo ranks",
        "",
        f"Run {result['started']} on {result['cores']} shared cores; `python "
        "bench/distributed_prediction.py` under the bench lock. Rank 0's peak traced on the fake "
        "process group vs rank 0's tracked peak (`MemoryTracker`, 512-byte storages) over two "
        "real steps on W gloo processes; every other rank is traced too (`trace_rank(..., "
        "rank=r)`) and compared with its own measured peak (last column, and the section "
        "'Other ranks'). Models: "
        f"hf-causal-lm {HF_MODEL}; digits-cnn {CNN_MODEL}.",
        "",
        *gathered_note(result),
        f"**{ranks - rank_misses} of {ranks} ranks in {len(rows) - len(misses)} of "
        f"{len(rows)} cases within {TOLERANCE:.1%}; largest error of any rank {worst:.4%}.**",
        "",
        "| task | W | strategy | global batch | accum. | ckpt | predicted | measured rank 0 | "
        "error | reserved (allocator model) | trace s | load | worst rank's error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['world_size']} | {wrapper(r)} | {r['global_batch']} | "
            f"{r['accumulation']} | {'yes' if r['checkpointing'] else 'no'} | "
            f"{r['predicted_allocated']:,} | "
            f"{r['measured_rank0']:,} | {r['error']:+.4%} | {r['predicted_reserved']:,} | "
            f"{r['trace_seconds']:.2f} | {r['load_1min']:.1f} | {r['worst_rank_error']:.4%} |"
        )
    lines += [
        "",
        "## Prediction time against world size",
        "",
        f"hf-causal-lm {SCALING_CONFIG} (per-rank batch 64 / W), median of 3 traces after a "
        "warm-up trace; one real steady-state step on 2 gloo ranks beside it.",
        "",
        "| strategy | W | trace wall s | trace CPU s | predicted rank-0 bytes | load |",
        "|---|---|---|---|---|---|",
    ]
    for t in result["scaling"]:
        lines.append(
            f"| {t['strategy']} | {t['world_size']} | {t['wall_seconds']:.2f} | "
            f"{t['cpu_seconds']:.2f} | {t['allocated']:,} | {t['load_1min']:.1f} |"
        )
    lines.append("")
    for strategy, step in result["real_step"].items():
        lines.append(
            f"- one real {strategy} step (W=2, per-rank batch 32): "
            f"{step['step_seconds']:.2f} s wall (load {step['load_1min']:.1f})"
        )
    lines += ["", *rank_spread(rows), ""]
    cost = result["isolation"]
    lines += [
        f"- a trace in a fresh subprocess (imports included): {cost['subprocess_seconds']:.1f} s "
        f"wall vs {cost['in_process_seconds']:.2f} s in-process (load {cost['load_1min']:.1f}); "
        "the fake group is destroyed in-process after each trace, so no subprocess is needed.",
        "",
    ]
    return "\n".join(lines)


def gathered_note(result: dict[str, Any]) -> list[str]:
    """When the kept-gathered cases were measured apart from the rest (`--only-gathered`)."""
    if "gathered_started" not in result:
        return []
    return [
        f"The FSDP2 cases keeping parameters gathered ('fsdp (kept gathered)') were measured "
        f"{result['gathered_started']} (`--only-gathered`); the other rows and the timings "
        f"{result['started']}.",
        "",
    ]


def wrapper(row: dict[str, Any]) -> str:
    """The row's strategy, FSDP2 keeping its parameters gathered named so (rows measured
    before that case existed lack the key: they resharded)."""
    kept = not row.get("reshard_after_forward", True)
    return f"{row['strategy']} (kept gathered)" if kept else str(row["strategy"])


def rank_spread(rows: list[dict[str, Any]]) -> list[str]:
    """The cases where another rank's peak differs from rank 0's: each rank, both ways."""
    spread = [
        r
        for r in rows
        if len(set(r["measured_all_ranks"])) > 1 or len(set(r["predicted_all_ranks"])) > 1
    ]
    lines = [
        "## Other ranks",
        "",
        f"In {len(spread)} of {len(rows)} cases another rank's peak differs from rank 0's "
        "(predicted or measured); each rank's own trace against its own measurement:",
        "",
    ]
    for r in spread:
        lines.append(
            f"- {r['task']} W={r['world_size']} {wrapper(r)} batch {r['global_batch']} "
            f"accum. {r['accumulation']} ckpt {'yes' if r['checkpointing'] else 'no'}: "
            f"predicted {r['predicted_all_ranks']}, measured {r['measured_all_ranks']} bytes"
        )
    return lines


def merged_gathered(saved: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """`saved` with its kept-gathered rows measured again (or for the first time)."""
    resharding = [r for r in saved["accuracy"] if r.get("reshard_after_forward", True)]
    started = datetime.now(UTC).isoformat(timespec="seconds")
    measured = [row for w in (2, 4) for row in accuracy(w, gathered=True)]
    result = {**saved, "accuracy": resharding + measured, "gathered_started": started}
    return result, render(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--render", type=Path, help="re-render the report from a results JSON, measuring nothing"
    )
    parser.add_argument(
        "--only-gathered",
        action="store_true",
        help="measure only the FSDP2 cases keeping parameters gathered, merged into --out's",
    )
    args = parser.parse_args()
    if args.render is not None:
        saved = json.loads(args.render.read_text())
        write_report(args.out, "distributed_prediction", saved, render(saved))
        return
    if args.only_gathered:
        saved = json.loads((args.out / "distributed_prediction.json").read_text())
        write_report(args.out, "distributed_prediction", *merged_gathered(saved))
        return

    result: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "tolerance": TOLERANCE,
        "accuracy": [
            row for w in (2, 4) for gathered in (False, True) for row in accuracy(w, gathered)
        ],
    }
    for strategy in STRATEGIES:  # warm-up: imports, first-trace costs
        trace_timing(strategy, 2, repeats=1)
    result["scaling"] = [
        trace_timing(strategy, w) for strategy in STRATEGIES for w in SCALING_WORLD_SIZES
    ]
    result["real_step"] = real_step_seconds()
    result["isolation"] = subprocess_cost()
    write_report(args.out, "distributed_prediction", result, render(result))


if __name__ == "__main__":
    main()
