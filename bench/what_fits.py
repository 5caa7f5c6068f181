"""What fits on which card: how many configurations run as asked, resized by the old ladder,
resized only by the new rungs, or nowhere, on card sizes of 8, 16, 24, 48 and 80 GiB.

Predicted only (nothing runs): the worker's own plan choice (vramtune/worker/plan/policy.py) on CUDA
cards, traced on fake cpu with CUDA's kernel choices emulated (a GPU worker traces on fake
cuda). Two ladders, both with the policy's 10 % margin:

- old: the ladder before issue 32, examples/hf-causal-lm.yaml's `resizes` (OLD);
- new: every rung in NEW, one entry each (a rung that lands later is one more entry; the
  report names the rungs vramtune.service.wire.Resize has that NEW leaves out).

A configuration counts as "new rungs only" when the old ladder hands it back and the new one
runs it. Workloads: a seeded sample of examples/hf-causal-lm.yaml's search space, the space's
largest configuration of each model type (every shape parameter at its largest: the peak grows
with each, so where these run as asked the whole space does), and a 1B-parameter Llama-style
config (Llama 3.2 1B's shapes: 16 layers, width 2048, 32 heads / 8 KV heads, MLP 8192,
vocabulary 128,256, tied embeddings) at 2,048 tokens, full training, LoRA r = 16 and LoRA
r = 16 on an int8 base (QLoRA, torchao), batch 1 and 8, built from its config, never
downloaded. The slowdown of each rung is the step-time model's prior (no fleet runs here):
the median, over the plans that used the rung, of the predicted time per step against as
asked.

Cost: a prediction does not depend on the card's size (only the budget does), so the
predictor's own cache (vramtune/worker/predictor/core.py, keyed by task, shapes, plan and card
constants) serves all five cards and both ladders: each plan is traced once. What costs is
the trace of the evaluation, which runs every held-out chunk at the plan's micro-batch (twice:
a warm-up, then the counted run); the 1B config evaluates 8 windows rather than the task's
default 64 (48 at 2,048 tokens), which leaves every peak as it is (each chunk of the plan's
micro-batch allocates what the first does; the predictor's cache key leaves the windows out
for that reason; `eval_windows_check` compares both to the byte, `--windows-check-only`) and
costs a 1B micro-batch-1 trace 16 forward passes instead of 96.

Writes ``what_fits.{md,json}`` under ``--out`` (default bench/results/), with the 1-minute load
average at the start and end of each workload in each run.
Usage: ``flock /tmp/bench.lock python bench/what_fits.py [--sample 12] [--resume]`` (`--resume`
keeps the rows already in the json and runs only the configurations not there yet).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, get_args

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import write_report  # noqa: E402
from vramtune.common.memory import peak_of  # noqa: E402
from vramtune.common.plans import plan_in_words, rungs_of  # noqa: E402
from vramtune.service.wire import CardInfo, MemoryPolicy, Plan, Resize  # noqa: E402
from vramtune.worker.plan.policy import (  # noqa: E402
    Decision,
    RunAsPlanned,
    choose_plan,
    expected_slowdown,
)
from vramtune.worker.predictor import core as predictor  # noqa: E402
from vramtune.worker.run.training import TorchTaskRunner  # noqa: E402
from vramtune.worker.tasks.hf import HFCausalLMTask  # noqa: E402
from vramtune.worker.trial.runner import CardSpec, plan_for_micro_batch  # noqa: E402
from vramtune.worker.trial.task import TaskConfigError  # noqa: E402

GIB = 1024**3
CARDS_GIB = [8, 16, 24, 48, 80]
# What a Hopper worker measures at start (FACTS.md): cuBLAS workspace per handle. The CUDA
# context (300-400 MiB) is outside torch's pool: a card's free memory is counted without it.
CONSTANTS = {"cublas_workspace_bytes": 32 * 1024**2}
CONTEXT_BYTES = 400 * 1024**2
OLD: list[Resize] = ["micro_batch", "checkpointing", "bf16"]
NEW: list[Resize] = [  # every rung in main when this ran, in the ladder's order
    "micro_batch",
    "selective_checkpointing",
    "checkpointing",
    "chunked_cross_entropy",
    "activation_offload",
    "optimizer_offload",
    "bf16",
    "adamw_8bit",
    "adafactor",
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
    "eval_windows": 8,  # the largest batch: every plan's evaluation chunks, 8 passes at most
}
BATCHES_1B = (1, 8)
OUTCOMES = ["as asked", "old ladder", "new rungs only", "infeasible"]
SAMPLE = "examples/hf-causal-lm.yaml (seeded sample)"
LARGEST = "examples/hf-causal-lm.yaml (largest configuration of each model type)"
LLAMA = "Llama-style 1B at 2,048 tokens (full, LoRA r = 16, LoRA r = 16 on an int8 base)"
DETAILED = 8  # a workload of at most this many configurations lists each row's plans


RUNG_ALONE: dict[str, Plan] = {
    "micro_batch": plan_for_micro_batch(8, 1),
    "selective_checkpointing": Plan(checkpointing=True, checkpoint_blocks=8),
    "checkpointing": Plan(checkpointing=True),
    "chunked_cross_entropy": Plan(chunked_loss=True),
    "activation_offload": Plan(activation_offload=True),
    "optimizer_offload": Plan(optimizer_offload=True),
    "bf16": Plan(bf16=True),
    "adamw_8bit": Plan(optimizer="adamw_8bit"),
    "adafactor": Plan(optimizer="adafactor"),
}


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


def largest_per_model_type() -> list[dict[str, Any]]:
    """The space's largest configuration of each model type: every int at its high end, every
    other categorical at its largest choice (the most heads and KV heads that build)."""
    space = example_space()
    by_type: dict[str, dict[str, Any]] = {}
    for config in space:
        best = by_type.get(config["model_type"])
        if best is None or _size(config) > _size(best):
            by_type[config["model_type"]] = config
    return list(by_type.values())


def _size(config: dict[str, Any]) -> tuple[int, ...]:
    keys = ("num_hidden_layers", "hidden_size", "seq_len", "batch_size", "num_attention_heads")
    return (*(config[k] for k in keys), config["num_key_value_heads"])


def llama_1b() -> list[dict[str, Any]]:
    """The 1B config, full training, LoRA r = 16 and LoRA r = 16 on an int8 base (QLoRA), at
    each of BATCHES_1B: full training first (where the new rungs can change most)."""
    lora = {"method": "lora", "r": 16, "lora_alpha": 32}
    tunings: list[dict[str, Any]] = [
        {},
        {"finetune": lora},
        {"finetune": {**lora, "quantized_base": "int8"}},
    ]
    return [
        {**LLAMA_1B, **tuning, "batch_size": batch} for tuning in tunings for batch in BATCHES_1B
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
    as_asked = peak_of(runner.predict(config, Plan(), spec))  # cached: the choice made it
    row: dict[str, Any] = {
        "card_gib": size_gib,
        "outcome": outcome,
        "as_asked_gib": as_asked / GIB,
        "old": _words(old),
        "new": _words(new),
        "new_rungs": [],
        "seconds": old.seconds + new.seconds,
    }
    if isinstance(new, RunAsPlanned):
        blocks = runner.checkpoint_block_count(config)
        row["new_rungs"] = rungs_of(new.plan)
        row["new_plan"] = new.plan.model_dump(exclude={"reason"})
        row["slowdown"] = expected_slowdown(new.plan, runner.batch_size(config), None, blocks)
    return row


def _words(decision: Decision) -> str:
    """The plan chosen in words, or why the trial is handed back (its smallest plan's need)."""
    if isinstance(decision, RunAsPlanned):
        return plan_in_words(decision.plan)
    return f"hand back (smallest plan needs {decision.min_footprint_bytes / GIB:.2f} GiB)"


def measure(
    name: str,
    configs: Iterable[dict[str, Any]],
    save: Callable[[dict[str, Any]], None],
    earlier: dict[str, Any] | None = None,
    run: int = 1,
) -> dict[str, Any]:
    """Every configuration on every card, with the load before and after and the seconds;
    `save` gets the result so far after each configuration. A configuration whose rows on
    every card are in `earlier` (an earlier run's result, `--resume`) keeps them, not rerun."""
    runner = TorchTaskRunner(HFCausalLMTask())
    start = {
        "run": run,
        "started_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_1min_start": os.getloadavg()[0],
    }
    started, traced_before = time.perf_counter(), len(predictor._PREDICTIONS)  # a trace an entry
    done = {
        _row_key(row): row for row in (earlier or {}).get("rows", []) if row["outcome"] != "error"
    }
    runs = _runs(earlier) if earlier else []
    rows: list[dict[str, Any]] = []
    measured = 0
    for config in configs:
        kept = [done.get(key) for key in _keys(config)]
        if all(kept):
            rows += kept
            continue
        for size in CARDS_GIB:  # largest first or not: the cache serves every card alike
            try:
                row = classify(runner, config, size)
            except TaskConfigError as error:
                row = {"card_gib": size, "outcome": "cannot build", "error": str(error)}
            except Exception as error:  # recorded in the results, the other rows still run
                row = {"card_gib": size, "outcome": "error", "error": repr(error)}
            rows.append({**row, "config": config, "run": run})
            print(f"{name}: {size} GiB {row['outcome']}: {row.get('new', '')}", flush=True)
        measured += 1
        this_run = _run(start, measured, started, traced_before)
        save({"workload": name, "rows": rows, "runs": [*runs, this_run]})
    this_run = _run(start, measured, started, traced_before)
    return {"workload": name, "rows": rows, "runs": [*runs, this_run] if measured else runs}


def _row_key(row: dict[str, Any]) -> tuple[str, int]:
    """A row's configuration and card: what `--resume` matches rows by."""
    return json.dumps(row["config"], sort_keys=True), row["card_gib"]


def _keys(config: dict[str, Any]) -> list[tuple[str, int]]:
    """The keys of a configuration's rows, one a card."""
    return [_row_key({"config": config, "card_gib": size}) for size in CARDS_GIB]


def _run(start: dict[str, Any], configs: int, started: float, traced_before: int) -> dict[str, Any]:
    """One run's share of a workload: its configurations, seconds, traces and load."""
    return {
        **start,
        "configs": configs,
        "seconds": time.perf_counter() - started,
        "traces": len(predictor._PREDICTIONS) - traced_before,
        "load_1min_end": os.getloadavg()[0],
    }


def _runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A workload's runs; a result written before `--resume` was one run (run 1)."""
    if "runs" in result:
        return list(result["runs"])
    keys = ("seconds", "traces", "load_1min_start", "load_1min_end")
    configs = len(result["rows"]) // len(CARDS_GIB)
    return [{"run": 1, "configs": configs, **{k: result[k] for k in keys}}]


def eval_windows_check() -> list[dict[str, Any]]:
    """The 1B config's shapes at 2 layers, predicted with 64 held-out windows (the task's
    default) and with 8 (the bench's), as asked and at micro-batch 1 with checkpointing: the
    bytes must be equal, only the seconds differ. The cache is cleared before each: its key
    leaves the held-out windows out (they are no shape parameter), so it would answer the
    second from the first."""
    task, (spec, _) = HFCausalLMTask(), card(CARDS_GIB[0])
    rows = []
    for plan in (Plan(), plan_for_micro_batch(8, 1, checkpointing=True)):
        for windows in (64, 8):
            config = {**LLAMA_1B, "num_hidden_layers": 2, "batch_size": 8, "eval_windows": windows}
            predictor.clear_cache()
            prediction = predictor.predict(task, config, plan, spec)
            rows.append(
                {
                    "plan": plan_in_words(plan),
                    "eval_windows": windows,
                    "peak_allocated_bytes": prediction.peak_allocated_bytes,
                    "peak_reserved_bytes": prediction.peak_reserved_bytes,
                    "evaluation_peak_bytes": prediction.evaluation_peak_bytes,
                    "seconds": prediction.seconds,
                    "load_1min": os.getloadavg()[0],
                }
            )
    return rows


def _eval_windows_section(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = [
        "## Held-out windows: the 1B config evaluates 8, which leaves every peak as it is",
        "",
        "The 1B shapes at 2 layers on the 8 GiB card's trace, with the task's default 64",
        "windows (48 at 2,048 tokens in the held-out text) and with the bench's 8:",
        "",
        "| plan | windows | peak allocated | peak reserved | evaluation peak | s | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['plan']} | {row['eval_windows']} | {row['peak_allocated_bytes']:,} "
            f"| {row['peak_reserved_bytes']:,} | {row['evaluation_peak_bytes'] or 0:,} "
            f"| {row['seconds']:.0f} | {row['load_1min']:.1f} |"
        )
    return [*lines, ""]


def counts(result: dict[str, Any]) -> dict[int, dict[str, int]]:
    """Per card size, how many configurations had each outcome."""
    table = {size: dict.fromkeys(OUTCOMES, 0) for size in CARDS_GIB}
    for row in result["rows"]:
        if row["outcome"] in OUTCOMES:
            table[row["card_gib"]][row["outcome"]] += 1
    return table


def report(
    results: list[dict[str, Any]],
    planned: dict[str, list[dict[str, Any]]],
    space_size: int,
    windows: list[dict[str, Any]],
) -> str:
    left_out = [rung for rung in get_args(Resize) if rung not in NEW]
    lines = [
        "# What fits: configurations per card size, old ladder against the new rungs",
        "",
        "Predicted only (`bench/what_fits.py`, the worker's own plan choice on CUDA cards traced",
        "on fake cpu with CUDA's kernels emulated; margin 10 %; the card's free memory is its",
        "size less a 400 MiB CUDA context).",
        "",
        f"- Old ladder (before issue 32, the example's `resizes`): {', '.join(OLD)}.",
        f"- New ladder (every rung in main when this ran): {', '.join(NEW)}.",
        "- Rungs vramtune.service.wire.Resize has that the new ladder leaves out: "
        + (", ".join(left_out) if left_out else "none")
        + ".",
        "",
        "'new rungs only': the old ladder hands it back, the new one runs it. The example's",
        f"space has {space_size} configurations (lr aside); a seeded sample of"
        f" {len(planned[SAMPLE])} is",
        "classified, and the largest configuration of each model type bounds the rest.",
        "",
        "Each row says the run that classified it: `--resume` keeps the rows already written",
        "and runs only the rest, so a workload may span runs (run 1 predates `--resume` and",
        "recorded no start time); each run's load is beside it.",
        "",
    ]
    for result in results:
        lines += _workload_section(result)
    lines += _not_classified(results, planned, windows)
    lines += _bound_check(results)
    lines += _eval_windows_section(windows)
    lines += [
        "## Predicted slowdown of each rung (the new ladder's chosen plans)",
        "",
        "Time per step against as asked, by the step-time model's prior (no fleet runs here;",
        "a fleet's fit replaces it): median over the plans that used the rung, which may use",
        "others too.",
        "",
        "| rung | plans | median slowdown | range |",
        "|---|---|---|---|",
    ]
    for rung, (n, median, low, high) in slowdowns(results).items():
        lines.append(f"| {rung} | {n} | {median:.2f}x | {low:.2f}x-{high:.2f}x |")
    lines += [
        "",
        "Each rung alone by the same prior, for the 1B config at batch 8 (16 blocks):",
        "",
        "| rung | plan | slowdown |",
        "|---|---|---|",
    ]
    for rung, plan in RUNG_ALONE.items():
        slowdown = expected_slowdown(plan, 8, None, LLAMA_1B["num_hidden_layers"])
        lines.append(f"| {rung} | {plan_in_words(plan)} | {slowdown:.2f}x |")
    return "\n".join(lines) + "\n"


def _workload_section(result: dict[str, Any]) -> list[str]:
    """One workload's counts per card, and each row's plans when there are few."""
    configs = len(result["rows"]) // len(CARDS_GIB)
    lines = [
        f"## {result['workload']}",
        "",
        f"{configs} configurations x {len(CARDS_GIB)} cards x 2 ladders:",
        "",
    ]
    for run in _runs(result):
        lines.append(
            f"- run {run['run']}"
            + (f" (started {run['started_utc']})" if "started_utc" in run else "")
            + f": {run['configs']} configurations, {run['seconds']:.0f} s, {run['traces']} traces;"
            f" load (1 min) {run['load_1min_start']:.1f} at the start,"
            f" {run['load_1min_end']:.1f} at the end."
        )
    lines += [
        "",
        "| card | " + " | ".join(OUTCOMES) + " |",
        "|---|" + "---|" * len(OUTCOMES),
    ]
    for size, row in counts(result).items():
        lines.append(f"| {size} GiB | " + " | ".join(str(row[o]) for o in OUTCOMES) + " |")
    lines.append("")
    if configs > DETAILED:
        return lines
    lines += [
        "| config | as asked needs | card | outcome | old ladder | new ladder | slowdown | run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        slowdown = f"{row['slowdown']:.2f}x" if "slowdown" in row else ""
        lines.append(
            f"| {_config_words(row['config'])} | {row.get('as_asked_gib', 0):.2f} GiB "
            f"| {row['card_gib']} GiB | {row['outcome']} | {row.get('old', '')} "
            f"| {row.get('new', '')} | {slowdown} | {row.get('run', 1)} |"
        )
    return [*lines, ""]


def _not_classified(
    results: list[dict[str, Any]],
    planned: dict[str, list[dict[str, Any]]],
    windows: list[dict[str, Any]],
) -> list[str]:
    """What the runs so far have not classified (a run cut off at a deadline), per workload."""
    done = {
        _row_key(row) for result in results for row in result["rows"] if row["outcome"] != "error"
    }
    lines = []
    for name, configs in planned.items():
        left = [c for c in configs if not done.issuperset(_keys(c))]
        if len(left) > DETAILED or len(left) == len(configs):
            lines.append(f"- {name}: {len(left)} of {len(configs)} configurations.")
        elif left:
            lines.append(f"- {name}: " + "; ".join(_config_words(c) for c in left) + ".")
    if not windows:
        lines.append("- The held-out windows check.")
    if not lines:
        lines = ["- Nothing: every planned configuration and the windows check are in."]
    return ["## Not classified yet", "", *lines, ""]


def _config_words(config: dict[str, Any]) -> str:
    """A configuration in a few words: the model type, its size, the batch, LoRA."""
    words = (
        f"{config['model_type']} L{config['num_hidden_layers']} d{config['hidden_size']} "
        f"T{config['seq_len']} b{config['batch_size']}"
    )
    finetune = config.get("finetune")
    if not finetune:
        return words
    base = finetune.get("quantized_base", "none")
    return words + f" LoRA r{finetune['r']}" + (f" on an {base} base" if base != "none" else "")


def _bound_check(results: list[dict[str, Any]]) -> list[str]:
    """Whether every sampled configuration needs at most its model type's largest one."""
    by_name = {result["workload"]: result for result in results}
    if SAMPLE not in by_name or LARGEST not in by_name:
        return []
    largest = {
        row["config"]["model_type"]: row["as_asked_gib"]
        for row in by_name[LARGEST]["rows"]
        if "as_asked_gib" in row
    }
    sampled = [  # of the model types whose largest is classified (a run may stop between)
        row
        for row in by_name[SAMPLE]["rows"]
        if "as_asked_gib" in row
        and row["card_gib"] == CARDS_GIB[0]
        and row["config"]["model_type"] in largest
    ]
    below = sum(row["as_asked_gib"] <= largest[row["config"]["model_type"]] for row in sampled)
    return [
        "## The whole space, bounded by its largest configurations",
        "",
        "As asked, the largest configuration of each model type needs "
        + ", ".join(f"{kind} {gib:.2f} GiB" for kind, gib in sorted(largest.items()))
        + f"; {below} of the {len(sampled)} sampled configurations of these types need no more than"
        " their model type's largest. The peak grows with every shape parameter, so a card"
        " whose budget holds the largest runs the whole space as asked.",
        "",
    ]


def slowdowns(results: list[dict[str, Any]]) -> dict[str, tuple[int, float, float, float]]:
    """Per rung: how many chosen plans used it, their median, least and largest slowdown."""
    by_rung: dict[str, list[float]] = {}
    for result in results:
        for row in result["rows"]:
            for rung in row.get("new_rungs", []):
                by_rung.setdefault(rung, []).append(row["slowdown"])
    return {
        rung: (len(v), statistics.median(v), min(v), max(v)) for rung, v in sorted(by_rung.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=12, help="configurations of the space")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument(
        "--windows-check-only",
        action="store_true",
        help="rerun only the held-out windows check into the results already written",
    )
    parser.add_argument(
        "--render-only", action="store_true", help="rewrite the md from the json already written"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows already in the json, run only the configurations not there yet",
    )
    args = parser.parse_args()
    space = example_space()
    sample = random.Random(args.seed).sample(space, min(args.sample, len(space)))
    # The 1B first (the rows the new rungs can change), the check of its held-out windows,
    # then the example's space (its largest configurations search the ladders at length).
    planned = {LLAMA: llama_1b(), SAMPLE: sample, LARGEST: largest_per_model_type()}
    figures: dict[str, Any] = {"new": NEW, "old": OLD, "results": [], "eval_windows_check": []}
    if args.windows_check_only or args.render_only or args.resume:
        figures = json.loads((args.out / "what_fits.json").read_text())

    def save(partial: dict[str, Any] | None = None) -> None:
        """Written after each configuration: a run cut off keeps what it measured."""
        results = figures["results"] + ([partial] if partial else [])
        text = report(results, planned, len(space), figures["eval_windows_check"])
        write_report(args.out, "what_fits", {**figures, "results": results}, text)

    if args.windows_check_only or args.render_only:
        if args.windows_check_only:
            figures["eval_windows_check"] = eval_windows_check()
        save()
        return
    earlier = {result["workload"]: result for result in figures["results"]}
    # Each workload's rows so far, in the results' order; this run's number follows theirs.
    run = 1 + max((r["run"] for result in earlier.values() for r in _runs(result)), default=0)
    for name, configs in planned.items():
        figures["results"] = [r for r in figures["results"] if r["workload"] != name]
        figures["results"].append(measure(name, configs, save, earlier.get(name), run))
        if name == LLAMA and not figures["eval_windows_check"]:
            figures["eval_windows_check"] = eval_windows_check()
        save()


if __name__ == "__main__":
    main()
