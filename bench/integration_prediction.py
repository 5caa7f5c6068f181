"""The Hugging Face Trainer integration: the traced training step against the real CPU run.

For each case, `TrainerTask.predict` (Trainer.train() traced for two steps under fake tensors)
beside the real `Trainer.train()` of the same arguments for `--steps` optimizer steps, its live
tensor bytes tracked by the worker's own counter (worker/device/memory.py, what a CPU worker
measures). Cases: the GPT-2 of examples/hf_trainer at a larger width, and a BERT sequence
classifier built from its config on synthetic tokens, each as asked and under the Trainer's own
knobs (per-device batch x accumulation, checkpointing, bf16).

Writes ``integration_prediction.{md,json}`` under ``--out`` (default bench/results/).
Usage: ``flock /tmp/vramtune-bench.lock python bench/integration_prediction.py``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples" / "hf_trainer"))

import torch  # noqa: E402

from bench.report import write_report  # noqa: E402
from vramtune.service.wire import Plan  # noqa: E402
from vramtune.worker.device.gpu import parse_size, simulated_card  # noqa: E402
from vramtune.worker.device.memory import MemoryTracker  # noqa: E402
from vramtune.worker.integrations.hf_trainer import TrainerTask  # noqa: E402
from vramtune.worker.trial.runner import CardSpec  # noqa: E402

CARD = CardSpec(info=simulated_card(parse_size("16GiB")))
BERT_LEN = 64


def gpt2_factory() -> dict[str, Any]:
    """The example's Trainer pieces (examples/hf_trainer/stdlib_gpt2.py), unchanged."""
    import copy

    import stdlib_gpt2

    return {
        "model_init": stdlib_gpt2.model_init,
        "args": copy.deepcopy(stdlib_gpt2.args),
        "train_dataset": stdlib_gpt2.train_dataset,
        "eval_dataset": stdlib_gpt2.eval_dataset,
        "data_collator": stdlib_gpt2.default_data_collator,
    }


def bert_model_init() -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=BERT_LEN,
        num_labels=3,
    )
    return BertForSequenceClassification(config)


def bert_rows(count: int, seed: int) -> list[dict[str, Any]]:
    """Synthetic token sequences; the label is a function of the first token."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (count, BERT_LEN), generator=generator)
    return [
        {"input_ids": row.tolist(), "attention_mask": [1] * BERT_LEN, "labels": int(row[0]) % 3}
        for row in ids
    ]


def bert_factory() -> dict[str, Any]:
    from transformers import TrainingArguments, default_data_collator

    return {
        "model_init": bert_model_init,
        "args": TrainingArguments(
            output_dir="bert-synthetic", per_device_train_batch_size=16, report_to=[]
        ),
        "train_dataset": bert_rows(256, 0),
        "eval_dataset": bert_rows(32, 1),
        "data_collator": default_data_collator,
    }


GPT2_WIDE = {"per_device_train_batch_size": 16, "n_layer": 4, "n_embd": 128}
BERT = {"per_device_train_batch_size": 16}
CASES: list[tuple[str, Callable[[], dict[str, Any]], dict[str, Any], str, Plan]] = [
    ("gpt2 4 x 128", gpt2_factory, GPT2_WIDE, "as asked", Plan()),
    ("gpt2 4 x 128", gpt2_factory, GPT2_WIDE, "4 x 4", Plan(micro_batch=4, accumulation=4)),
    ("gpt2 4 x 128", gpt2_factory, GPT2_WIDE, "checkpointing", Plan(checkpointing=True)),
    ("gpt2 4 x 128", gpt2_factory, GPT2_WIDE, "bf16", Plan(bf16=True)),
    ("bert 4 x 128", bert_factory, BERT, "as asked", Plan()),
    ("bert 4 x 128", bert_factory, BERT, "2 x 8", Plan(micro_batch=2, accumulation=8)),
    ("bert 4 x 128", bert_factory, BERT, "checkpointing", Plan(checkpointing=True)),
]


def real_peak(task: TrainerTask, config: dict[str, Any], plan: Plan, steps: int) -> int:
    """The tracked live bytes of the real `Trainer.train()` for `steps` steps, no evaluation."""
    import dataclasses

    setup = task.setup()
    args = dataclasses.replace(
        task.arguments(setup, config, plan, CARD),
        max_steps=steps,
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        output_dir="/tmp/vramtune-bench-trainer",
    )
    tracker = MemoryTracker(device_type="cpu")
    with tracker:
        task.build_trainer(setup, config, args, []).train()
    return tracker.peak_bytes


def run_case(
    name: str, factory: Callable[[], dict[str, Any]], config: dict[str, Any], plan: Plan, steps: int
) -> dict[str, Any]:
    task = TrainerTask(name.replace(" ", "-"), factory)
    began = time.perf_counter()
    predicted = task.predict(config, plan, CARD)
    trace_s = time.perf_counter() - began
    began = time.perf_counter()
    real = real_peak(task, config, plan, steps)
    real_s = time.perf_counter() - began
    return {
        "method": predicted.method,
        "reason": predicted.reason,
        "predicted": predicted.peak_allocated_bytes,
        "real": real,
        "error_pct": 100 * (predicted.peak_allocated_bytes - real) / real,
        "trace_s": trace_s,
        "real_s": real_s,
        "load_1min": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--steps", type=int, default=4, help="real optimizer steps per case")
    options = parser.parse_args()
    rows = []
    for model, factory, config, plan_name, plan in CASES:
        row = {
            "model": model,
            "plan": plan_name,
            **run_case(model, factory, config, plan, options.steps),
        }
        print(row, flush=True)
        rows.append(row)
    write_report(
        options.out, "integration_prediction", {"cases": rows}, render(rows, options.steps)
    )


def render(rows: list[dict[str, Any]], steps: int) -> str:
    import transformers

    within = sum(abs(r["error_pct"]) <= 0.1 for r in rows)
    exact = sum(r["predicted"] == r["real"] for r in rows)
    lines = [
        "# Hugging Face Trainer: the traced training step against the real CPU run",
        "",
        f"`python bench/integration_prediction.py` (torch {torch.__version__}, transformers "
        f"{transformers.__version__}, CPU). *predicted*: `TrainerTask.predict` (the user's "
        "Trainer's `train()` traced for two steps under fake tensors); *real*: the tracked peak "
        f"of live tensor bytes of the same Trainer's real `train()` over {steps} steps "
        "(no evaluation). Batch 16 as asked; micro-batches through `per_device_train_batch_size`"
        " x `gradient_accumulation_steps`; checkpointing and bf16 through the Trainer's own "
        "arguments. GPT-2: examples/hf_trainer (32 tokens); BERT: a 3-class sequence "
        f"classifier on {BERT_LEN} synthetic tokens.",
        "",
        "| model | plan | method | real (B) | predicted (B) | error | trace s | real s | load 1 min"
        " |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['plan']} | {r['method']} | {r['real']:,} | {r['predicted']:,} | "
            f"{r['error_pct']:+.4f} % | {r['trace_s']:.2f} | {r['real_s']:.2f} | "
            f"{r['load_1min']:.1f} |"
        )
    lines += [
        "",
        f"Within 0.1 %: {within} of {len(rows)} cases; exact to the byte: {exact} of {len(rows)}. "
        "Times are wall seconds on a shared 2-core machine.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
