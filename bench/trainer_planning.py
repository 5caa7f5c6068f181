"""How long a Hugging Face Trainer's plan choice takes (issue 43 item 2), and where the time goes.

The user's shape, small enough for a CPU: a GPT-2 built from a `GPT2Config` (no download), a
train set and a held-out set of fixed windows, `compute_metrics` set (so the evaluation loop
gathers every batch's logits on the device) and the Trainer's default evaluation batch,
wrapped as a `vramtune.TrainerTask`. For each `per_device_train_batch_size` (8, 32, 128, 512)
on simulated CPU cards of 64 MiB and 256 MiB, the plan choice the worker makes for a trial
(`choose_plan` through the fleet's shared predictions, as `worker.loop.agent` calls it; its
`seconds` is the worker's ``planning_s``), each case with a fresh task (nothing cached), the
1-minute load average and the CPU seconds beside the wall time. The profile counts the
traces the choice ran: whole Trainer traces (two training steps, then the evaluation), the
evaluation's own, and their seconds.

``--check-real`` then runs the chosen plan for real (two steps, one evaluation) on the same
simulated card and compares its measured peak with the plan's prediction (bytes, CPU).

    nice -n 19 python bench/trainer_planning.py --label before --json /tmp/before.json
    ... change the code ...
    nice -n 19 python bench/trainer_planning.py --label after --check-real \\
        --before /tmp/before.json

writes ``trainer_planning.{md,json}`` under ``--out`` (default bench/results/), the runs side by
side.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.report import write_report  # noqa: E402
from vramtune.service.wire import MemoryPolicy, TrainBudget  # noqa: E402
from vramtune.worker.device.gpu import parse_size, simulated_card  # noqa: E402
from vramtune.worker.integrations.hf_trainer import TrainerTask  # noqa: E402
from vramtune.worker.plan.policy import choose_plan  # noqa: E402
from vramtune.worker.plan.shared_predictions import shared  # noqa: E402
from vramtune.worker.trial.runner import CardSpec  # noqa: E402

SEQ_LEN = 64
VOCAB = 128
TRAIN_ROWS = 2048
EVAL_ROWS = 512
BATCHES = (8, 32, 128, 512)
CARDS = ("64MiB", "256MiB")
POLICY = MemoryPolicy(resizes=["micro_batch", "checkpointing"], margin=0.1)
TARGET_S = 10.0

PROFILED = (
    ("vramtune.worker.integrations.hf_trainer", "trace_trainer", "trainer"),
    ("vramtune.worker.integrations.hf_trainer_trace", "evaluation_part", "evaluation"),
    ("vramtune.worker.integrations.hf_trainer_trace", "trace_trainer_evaluation", "evaluation"),
)
"""Functions timed in the profile, where the code has them: (module, name, what)."""


def model_init(trial: dict[str, Any] | None = None) -> Any:
    """A GPT-2 from its config, as the user's script builds it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ_LEN,
        n_layer=2,
        n_embd=128,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def windows(count: int, shift: int) -> list[dict[str, list[int]]]:
    """`count` rows of SEQ_LEN token ids (the model shifts the labels itself)."""
    rows = [[(i * 7 + j * 3 + shift) % VOCAB for j in range(SEQ_LEN)] for i in range(count)]
    return [{"input_ids": row, "labels": row} for row in rows]


def accuracy(prediction: Any) -> dict[str, float]:
    """The user's `compute_metrics`: next-token accuracy over the gathered logits."""
    predicted = np.asarray(prediction.predictions).argmax(-1)[:, :-1]
    return {"accuracy": float((predicted == np.asarray(prediction.label_ids)[:, 1:]).mean())}


def trainer_kwargs() -> dict[str, Any]:
    """The Trainer's keyword arguments (the factory a TrainerTask calls for each trial)."""
    from transformers import TrainingArguments, default_data_collator

    return {
        "model_init": model_init,
        "args": TrainingArguments(
            output_dir="unused", per_device_train_batch_size=8, learning_rate=1e-3, report_to=[]
        ),
        "train_dataset": windows(TRAIN_ROWS, 0),
        "eval_dataset": windows(EVAL_ROWS, 5),
        "data_collator": default_data_collator,
        "compute_metrics": accuracy,
    }


class Profile:
    """Calls and seconds of the profiled functions (`PROFILED`) while it is entered."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    @contextmanager
    def counting(self) -> Iterator[None]:
        """Wrap every profiled function that exists; unwrap after."""
        undo = []
        for module_name, name, what in PROFILED:
            module = importlib.import_module(module_name)
            original = getattr(module, name, None)
            if original is None:
                continue
            setattr(module, name, self._timed(original, what))
            undo.append((module, name, original))
        try:
            yield
        finally:
            for module, name, original in undo:
                setattr(module, name, original)

    def _timed(self, function: Callable[..., Any], what: str) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.calls[what] = self.calls.get(what, 0) + 1
                self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - started

        return timed


def plan_choice(batch: int, card_size: str, check_real: bool) -> dict[str, Any]:
    """One cold plan choice for `batch` on a simulated card of `card_size`, profiled."""
    task = TrainerTask("gpt2-trainer", trainer_kwargs, metric="eval_loss")
    card = CardSpec(info=simulated_card(parse_size(card_size)))
    config = {"per_device_train_batch_size": batch}
    profile = Profile()
    load = os.getloadavg()[0]
    cpu = time.process_time()
    with profile.counting():
        decision = choose_plan(shared(task, config, []), config, POLICY, card, card.info.free_bytes)
    row: dict[str, Any] = {
        "batch": batch,
        "card": card_size,
        "load_1min": load,
        "planning_s": decision.seconds,
        "cpu_s": time.process_time() - cpu,
        "calls": profile.calls,
        "seconds": profile.seconds,
        "plan": decision.plan.model_dump(exclude_defaults=True) if decision.plan else None,
        "runs": hasattr(decision, "prediction"),
        # Steps run and replayed, batches jumped over (TrainerTask.counts, where it has them).
        "counts": dataclasses.asdict(task.counts) if hasattr(task, "counts") else None,
    }
    if hasattr(decision, "prediction"):
        prediction = decision.prediction
        row["predicted_bytes"] = prediction.peak_allocated_bytes
        row["predicted_evaluation_bytes"] = prediction.evaluation_peak_bytes
        if check_real:
            row.update(real_run(task, config, decision.plan, card))
    else:
        row["reason"] = decision.reason
    return row


class _Quiet:
    """A Reporter that never prunes nor stops."""

    def report(self, step: int, value: float) -> bool:
        return False

    def stop_reason(self) -> str | None:
        return None


def real_run(
    task: TrainerTask, config: dict[str, Any], plan: Any, card: CardSpec
) -> dict[str, Any]:
    """The chosen plan run for real: two steps, one evaluation; its measured peaks."""
    started = time.perf_counter()
    budget = TrainBudget(max_steps=2, eval_every=2)
    result = task.run(config, plan, budget, card, _Quiet())
    return {
        "measured_bytes": result.measured.peak_allocated_bytes,
        "measured_evaluation_bytes": result.measured.evaluation_peak_bytes,
        "real_s": time.perf_counter() - started,
    }


def commit() -> str:
    """The checked-out commit, with '+' when the tree has changes."""
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "vramtune"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return head + ("+" if dirty else "")


def run(label: str, check_real: bool, batches: list[int], cards: list[str]) -> dict[str, Any]:
    """Every case's plan choice, the cards outermost."""
    rows = []
    for card_size in cards:
        for batch in batches:
            row = plan_choice(batch, card_size, check_real)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return {
        "label": label,
        "commit": commit(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__,
        "rows": rows,
    }


def _fmt_profile(row: dict[str, Any]) -> str:
    parts = []
    for what in ("trainer", "evaluation"):
        if what in row["calls"]:
            parts.append(f"{row['calls'][what]} {what} ({row['seconds'][what]:.1f} s)")
    return ", ".join(parts) or "-"


def _fmt_plan(row: dict[str, Any]) -> str:
    plan = row["plan"] or {}
    if not row["runs"]:
        return "hand back"
    micro = plan.get("micro_batch") or row["batch"]
    text = f"micro {micro}"
    return text + (", ckpt" if plan.get("checkpointing") else "")


def _fmt_exact(row: dict[str, Any]) -> str:
    if "measured_bytes" not in row:
        return "-"
    same = row["measured_bytes"] == row["predicted_bytes"]
    return f"{row['measured_bytes']:,} ({'exact' if same else 'DIFFERS'})"


def markdown(runs: list[dict[str, Any]]) -> str:
    """The report: per case, each run's planning seconds and profile side by side."""
    by_case = [{(r["card"], r["batch"]): r for r in run["rows"]} for run in runs]
    labels = " / ".join(f"{run['label']} ({run['commit']}, {run['when']})" for run in runs)
    head = "| card | batch |" + "".join(
        f" {run['label']}: planning s (CPU s, load 1 min) |" for run in runs
    )
    head += "".join(f" {run['label']}: traces |" for run in runs)
    head += " plan | predicted peak (B) | measured peak (B) |"
    lines = [
        "# Planning a Hugging Face Trainer configuration (issue 43 item 2)",
        "",
        f"`python bench/trainer_planning.py` (torch {runs[-1]['torch']}, CPU, a shared 2-core "
        "machine): the worker's plan choice (`choose_plan` through the shared "
        "predictions, its `planning_s`) for a GPT-2 built from a `GPT2Config` (2 layers, "
        f"n_embd 128, context {SEQ_LEN}, vocabulary {VOCAB}) under a `TrainerTask` with "
        f"`compute_metrics`, {TRAIN_ROWS} training rows, {EVAL_ROWS} held-out rows evaluated "
        "whole in batches of 8 (the Trainer's default), resizes micro_batch and "
        "checkpointing, margin 10 %. Each case a fresh task (nothing cached). Runs: "
        f"{labels}. Target: at most {TARGET_S:.0f} s a plan.",
        "",
        head,
        "|---|---:|" + "---:|" * len(runs) + "---|" * len(runs) + "---|---:|---:|",
    ]
    for key in by_case[-1]:
        rows = [case.get(key) for case in by_case]
        last = rows[-1]
        assert last is not None
        cells = [
            f"{r['planning_s']:.1f} ({r['cpu_s']:.1f}, {r['load_1min']:.2f})" if r else "-"
            for r in rows
        ]
        profiles = [_fmt_profile(r) if r else "-" for r in rows]
        predicted = f"{last['predicted_bytes']:,}" if last["runs"] else "-"
        lines.append(
            f"| {key[0]} | {key[1]} | "
            + " | ".join(cells)
            + " | "
            + " | ".join(profiles)
            + f" | {_fmt_plan(last)} | {predicted} | {_fmt_exact(last)} |"
        )
    lines += ["", NOTE]
    return "\n".join(lines) + "\n"


NOTE = (
    "*traces*: the Trainer traces a plan choice ran (`trace_trainer`, two training steps "
    "each) and the full evaluations among them (`evaluation_part`), with their seconds. "
    "Before, every prediction traced every micro-batch of both accumulation windows (512 "
    "forward and backward passes each at a micro-batch of 1) and the whole held-out set in "
    "batches of the micro-batch (512 turns at 1): most of the 555 s went to the training "
    "windows, 76 s to 11 evaluations. After: the repeated steps of both loops are replayed, "
    "the evaluation loop jumps over its middle batches, each evaluation is traced once and "
    "counted in the other micro-batches' traces, and the search predicts no micro-batch of "
    "1 unless nothing larger fits (vramtune/worker/integrations/hf_trainer_trace.py). "
    "*measured peak*: the chosen plan run for real (two steps, one evaluation) on the same "
    "simulated card; the predictions are the same bytes before and after. Wall seconds on a "
    "shared 2-core machine (the load beside each)."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--check-real", action="store_true", help="run each chosen plan for real")
    parser.add_argument("--before", type=Path, help="an earlier run's --json, shown beside")
    parser.add_argument("--json", type=Path, help="also write this run alone here")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    parser.add_argument("--cards", nargs="*", default=list(CARDS))
    options = parser.parse_args()
    this = run(options.label, options.check_real, options.batches, options.cards)
    if options.json is not None:
        options.json.write_text(json.dumps(this, indent=2))
    runs = [json.loads(options.before.read_text()), this] if options.before else [this]
    write_report(options.out, "trainer_planning", {"runs": runs}, markdown(runs))


if __name__ == "__main__":
    main()
