"""What combining rungs costs a plan choice: the predictions the fit policy (worker/plan/policy.py)
asks of the predictor, and its seconds, on examples/hf-causal-lm.yaml's largest configuration.

Predicted only, on the CPU card (fake tensors, nothing runs). The policy allows every rung that
keeps the numerics and bf16 (bench/what_fits.py's new ladder); each budget (margin 0) is set
from the predicted peaks of that configuration so that one kind of plan is the cheapest to fit:

- as asked: the as-asked peak;
- one rung: half the as-asked peak (micro-batches, or one rung with them);
- combination only: between the smallest plan of every block checkpointed and the chunked
  loss, both at a micro-batch of 1, and the smaller of those two plans alone;
- nothing: one byte below the smallest plan of all (the policy's one-trace shortcut).

Counted: calls of vramtune.worker.predictor's predict (the solver's included), the predictor's cache
cleared before each choice, so each call is a trace or a probe. Writes
``rung_combinations.{md,json}`` under ``--out`` (default bench/results/) with the 1-minute load
average beside each figure.
Usage: ``flock /tmp/bench.lock python bench/rung_combinations.py [--label after]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import vramtune.worker.predictor as predictor_package  # noqa: E402
from vramtune.common.memory import peak_of  # noqa: E402
from vramtune.common.plans import rungs_of  # noqa: E402
from vramtune.service.wire import CardInfo, MemoryPolicy, Plan, Resize  # noqa: E402
from vramtune.worker.plan.policy import RunAsPlanned, choose_plan  # noqa: E402
from vramtune.worker.predictor import clear_cache, core  # noqa: E402
from vramtune.worker.run.training import TorchTaskRunner  # noqa: E402
from vramtune.worker.tasks.hf import HFCausalLMTask  # noqa: E402
from vramtune.worker.trial.runner import CardSpec, plan_for_micro_batch  # noqa: E402

RESIZES: list[Resize] = [
    "micro_batch",
    "selective_checkpointing",
    "checkpointing",
    "chunked_cross_entropy",
    "bf16",
]
CPU_CARD = CardSpec(info=CardInfo(model="cpu", total_bytes=2**40, free_bytes=2**40))


def largest_config() -> dict[str, Any]:
    """The search space's largest choice of every parameter that sets memory (lr aside)."""
    study = yaml.safe_load((REPO / "examples" / "hf-causal-lm.yaml").read_text())
    config = dict(study["task_config"])
    for name, spec in study["search_space"].items():
        if spec["type"] == "categorical":
            config[name] = max(spec["choices"]) if name != "model_type" else "llama"
        elif spec["type"] == "int":
            config[name] = spec["high"]
    return config


class Counted:
    """Counts the calls of vramtune.worker.predictor's predict while it is installed."""

    def __init__(self) -> None:
        self.calls = 0
        self.original: Callable[..., Any] = core.predict

    def __enter__(self) -> Counted:
        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self.original(*args, **kwargs)

        core.predict = counting
        predictor_package.predict = counting  # type: ignore[attr-defined]
        return self

    def __exit__(self, *_: object) -> None:
        core.predict = self.original
        predictor_package.predict = self.original  # type: ignore[attr-defined]


def budgets(runner: TorchTaskRunner, config: dict[str, Any]) -> dict[str, int]:
    """The budget of each scenario, from the configuration's predicted peaks."""
    batch = runner.batch_size(config)

    def peak(**flags: Any) -> int:
        return peak_of(runner.predict(config, plan_for_micro_batch(batch, 1, **flags), CPU_CARD))

    every, chunked = peak(checkpointing=True), peak(chunked_loss=True)
    both = peak(checkpointing=True, chunked_loss=True)
    smallest = peak(checkpointing=True, chunked_loss=True, bf16=True)
    asked = peak_of(runner.predict(config, Plan(), CPU_CARD))
    return {
        "as asked": asked,
        "one rung": asked // 2,
        "combination only": (both + min(every, chunked)) // 2,
        "nothing": smallest - 1,
    }


def choose(runner: TorchTaskRunner, config: dict[str, Any], budget: int) -> dict[str, Any]:
    """One plan choice from a cold predictor cache: its plan, predictions and seconds."""
    clear_cache()
    load = os.getloadavg()[0]
    policy = MemoryPolicy(resizes=RESIZES, margin=0.0)
    with Counted() as counted:
        decision = choose_plan(runner, config, policy, CPU_CARD, budget)
    row: dict[str, Any] = {"predictions": counted.calls, "seconds": round(decision.seconds, 2)}
    row["load_1min"] = load
    if isinstance(decision, RunAsPlanned):
        row["plan"] = decision.plan.model_dump(exclude={"reason"})
        row["rungs"] = rungs_of(decision.plan)
    else:
        row["plan"], row["rungs"] = None, ["hand-back"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="after", help="the ladder measured (before/after)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    runner = TorchTaskRunner(HFCausalLMTask())
    config = largest_config()
    rows = {name: choose(runner, config, b) for name, b in budgets(runner, config).items()}
    path = args.out / "rung_combinations.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["config"] = config
    results[args.label] = rows
    path.write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        "# Rung combinations: predictions per plan choice",
        "",
        f"examples/hf-causal-lm.yaml's largest configuration: `{json.dumps(config)}`; "
        f"resizes {RESIZES}, margin 0, CPU card, cold predictor cache "
        "(bench/rung_combinations.py).",
        "",
        "| ladder | budget | plan's rungs | predictions | seconds | load (1 min) |",
        "|---|---|---|---|---|---|",
    ]
    for label in ("before", "after"):
        for name, row in results.get(label, {}).items():
            rungs = ", ".join(row["rungs"]) or "as asked"
            lines.append(
                f"| {label} | {name} | {rungs} | {row['predictions']} | {row['seconds']} "
                f"| {row['load_1min']:.2f} |"
            )
    (args.out / "rung_combinations.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
