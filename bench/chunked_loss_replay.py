"""The chunked cross-entropy's evaluation, traced with its chunks replayed or all run (issue 44).

A plan with the chunked_cross_entropy rung computes the loss a chunk of tokens at a time, as
many chunks as the vocabulary is times the width (a Llama of width 32 and vocabulary 16,384:
512 chunks per batch). The predictor traces the task's evaluation, warm-up included, after the
training steps, so every chunk of every held-out batch ran under fake tensors. The chunk calls
are marked repeated (vramtune/worker/trial/repeated.py) and a CPU trace replays them after two
alike (vramtune/worker/predictor/repeats.py).

Side by side in one run, for each configuration and plan: the prediction with the replay and
without it (the marked calls run as they are), wall and CPU seconds, the chunk calls run and
replayed, and whether both predictions and the real CPU run agree to the byte.

Usage: ``python bench/chunked_loss_replay.py [--repeats 2]``; writes
``chunked_loss_replay.{md,json}`` under ``--out`` (default bench/results/).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.predictor_speed import clocks, load  # noqa: E402
from bench.report import write_report  # noqa: E402
from vramtune.common.memory import peak_of  # noqa: E402
from vramtune.service.wire import Plan  # noqa: E402
from vramtune.worker.predictor import clear_cache, predict, trace  # noqa: E402
from vramtune.worker.predictor.repeats import RepeatedCalls  # noqa: E402
from vramtune.worker.tasks.hf import HFCausalLMTask  # noqa: E402

# tests/worker/test_rungs.py's Llama (a stdlib corpus of 20,000 characters, 4 held-out windows)
LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "corpus_chars": 20_000,
    "eval_windows": 4,
}
CONFIGS = {
    "2 layers, batch 4 x 32, vocab 4,096": {
        **LLAMA,
        "num_hidden_layers": 2,
        "batch_size": 4,
        "seq_len": 32,
        "vocab_size": 4096,
    },
    "2 layers, batch 1 x 256, vocab 16,384": {
        **LLAMA,
        "num_hidden_layers": 2,
        "batch_size": 1,
        "seq_len": 256,
        "vocab_size": 16384,
    },
    "4 layers, batch 1 x 512, vocab 8,192": {
        **LLAMA,
        "num_hidden_layers": 4,
        "batch_size": 1,
        "seq_len": 512,
        "vocab_size": 8192,
    },
}
PLANS = {
    "chunked": Plan(chunked_loss=True),
    "1 block checkpointed + chunked": Plan(
        checkpointing=True, checkpoint_blocks=1, chunked_loss=True
    ),
}


@contextmanager
def replay_off() -> Iterator[list[RepeatedCalls]]:
    """The trace as before: the marked calls run as they are (no stand-ins)."""
    original = trace.replayed
    trace.replayed = lambda tracker: nullcontext({})  # type: ignore[assignment,misc]
    try:
        yield []
    finally:
        trace.replayed = original


@contextmanager
def counting_calls() -> Iterator[list[RepeatedCalls]]:
    """The replaying stand-ins the traces inside the block made."""
    made: list[RepeatedCalls] = []
    original = trace.replayed

    @contextmanager
    def kept(tracker: Any) -> Iterator[Any]:
        with original(tracker) as calls:
            yield calls
            made.extend(calls.values())

    trace.replayed = kept  # type: ignore[assignment]
    try:
        yield made
    finally:
        trace.replayed = original


def real_peak(config: dict[str, Any], plan: Plan) -> int:
    """The real CPU run's peak of the predicted steps and evaluation (the tests' measure)."""
    sys.path.insert(0, str(REPO / "tests" / "worker"))
    from test_predictor import measured_cpu_peak

    return int(measured_cpu_peak(HFCausalLMTask(), config, plan))


def timed(config: dict[str, Any], plan: Plan, repeats: int, replay: bool) -> dict[str, Any]:
    """The median of `repeats` predictions, one way."""
    rows = []
    for _ in range(repeats):
        clear_cache()  # a first prediction each time, never the cached one
        with counting_calls() if replay else replay_off() as calls, clocks() as took:
            prediction = predict(HFCausalLMTask(), config, plan)
        rows.append(
            {
                **took,
                "peak": peak_of(prediction),
                "run": sum(c.run for c in calls),
                "replayed": sum(c.replayed for c in calls),
                "load": load(),
            }
        )
    return {
        "wall_s": statistics.median(r["wall_s"] for r in rows),
        "cpu_s": statistics.median(r["cpu_s"] for r in rows),
        "peak": rows[0]["peak"],
        "run": rows[0]["run"],
        "replayed": rows[0]["replayed"],
        "load": statistics.median(r["load"] for r in rows),
    }


def warm_up() -> None:
    """One small prediction first: imports and first-call costs out of the way."""
    predict(HFCausalLMTask(), next(iter(CONFIGS.values())), Plan())


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# The chunked cross-entropy's evaluation: chunks replayed vs all run",
        "",
        f"Run {result['when']} on 2 shared cores, torch threads 1; median of "
        f"{result['repeats']} predictions each way, one process, each case all run first, then "
        f"replayed. Load average (1 min) before {result['load_before']:.2f}, after "
        f"{result['load_after']:.2f}; per row the median load during each way.",
        "",
        "| configuration | plan | all run: wall s (cpu s) | replayed: wall s (cpu s) | "
        "speed-up (cpu) | chunk calls run / replayed | predicted = real (B) | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        before, after = row["all_run"], row["replayed"]
        exact = before["peak"] == after["peak"] == row["real_peak"]
        lines.append(
            f"| {row['config']} | {row['plan']} | {before['wall_s']:.1f} ({before['cpu_s']:.1f}) "
            f"| {after['wall_s']:.1f} ({after['cpu_s']:.1f}) "
            f"| {before['cpu_s'] / after['cpu_s']:.1f}x "
            f"| {after['run'] + after['replayed']} / 0 → {after['run']} / {after['replayed']} "
            f"| {'yes' if exact else 'NO'}: {row['real_peak']:,} "
            f"| {before['load']:.1f} / {after['load']:.1f} |"
        )
    lines += [
        "",
        "A prediction here is the whole trace: build, two training steps, the evaluation's "
        "uncounted warm-up and its counted run. The chunk calls are run and replayed in the "
        "evaluation only; the training steps' chunks run as before (their outputs carry a "
        "gradient graph, which a replay does not make).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Measure and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "repeats": args.repeats,
        "load_before": load(),
        "rows": [],
    }
    warm_up()
    for name, config in CONFIGS.items():
        for plan_name, plan in PLANS.items():
            row = {"config": name, "plan": plan_name, "real_peak": real_peak(config, plan)}
            row["all_run"] = timed(config, plan, args.repeats, replay=False)
            row["replayed"] = timed(config, plan, args.repeats, replay=True)
            result["rows"].append(row)
            print(row, flush=True)
    result["load_after"] = load()
    write_report(args.out, "chunked_loss_replay", result, markdown(result))


if __name__ == "__main__":
    main()
