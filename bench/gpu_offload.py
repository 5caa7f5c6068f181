"""The offload rungs on a real card (issue 32): each rung's predicted peak against
`torch.cuda.max_memory_allocated`, and its measured step time against running as asked.

On a machine with a CUDA GPU: for a char transformer and a tiny Llama (hf-causal-lm), each plan
of {as asked, activation_offload, optimizer_offload, both} is predicted as the worker predicts
it (`worker.predictor.predict` on the card: fake `cuda`, host copies on fake `cpu`, only the
card's bytes counted) and then run by the worker's own loop (`TorchTaskRunner.run`, which
measures `max_memory_allocated` / `max_memory_reserved` and samples per second). Without a GPU
the prediction can only be checked on the emulated trace (tests/worker/test_offload.py): this
is where the card's bytes are measured.

    python bench/gpu_offload.py --out DIR     # writes DIR/gpu_offload.{md,json}

Without a CUDA device it says so and exits with status 2, writing nothing. bench/gpu_check.sh
runs it.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.gpu_common import HF_CONFIG, Quiet, percent, relative_error  # noqa: E402
from bench.report import write_report  # noqa: E402
from vramtune.service.wire import Plan, TrainBudget  # noqa: E402
from vramtune.worker.trial.runner import CardSpec  # noqa: E402
from vramtune.worker.trial.task import Config, Task  # noqa: E402

BUDGET = TrainBudget(max_steps=6, eval_every=6)
PLANS = {
    "as asked": Plan(),
    "activation_offload": Plan(activation_offload=True),
    "optimizer_offload": Plan(optimizer_offload=True),
    "both": Plan(activation_offload=True, optimizer_offload=True),
}
CHAR_CONFIG: Config = {
    "n_layers": 4,
    "d_model": 256,
    "n_heads": 4,
    "seq_len": 256,
    "batch_size": 16,
}


def families() -> list[tuple[Task, Config]]:
    """A plain-PyTorch decoder and a transformers Llama."""
    from vramtune.worker.tasks.charlm import CharTransformerTask
    from vramtune.worker.tasks.hf import HFCausalLMTask

    return [(CharTransformerTask(), CHAR_CONFIG), (HFCausalLMTask(), HF_CONFIG)]


def gpu_card() -> CardSpec:
    """The first GPU, as a worker sees it, with its constants measured."""
    from vramtune.worker.device.gpu import card_for_device
    from vramtune.worker.predictor import measure_card_constants

    constants = dict(measure_card_constants("cuda:0").model_dump())
    return CardSpec(info=card_for_device("cuda:0"), constants=constants, device="cuda:0")


def one_case(task: Task, config: Config, name: str, plan: Plan, card: CardSpec) -> dict[str, Any]:
    """One plan predicted on the card, then run there."""
    from vramtune.common.step_time import default_step_time_fit, step_time_slowdown
    from vramtune.worker.plan.policy import step_features
    from vramtune.worker.predictor import predict
    from vramtune.worker.run.training import TorchTaskRunner

    predicted = predict(task, config, plan, card)
    result = TorchTaskRunner(task).run(config, plan, BUDGET, card, Quiet())
    measured = result.measured
    prior = step_time_slowdown(default_step_time_fit(), step_features(plan, config["batch_size"]))
    return {
        "task": task.name,
        "plan": name,
        "method": predicted.method,
        "predicted_allocated": predicted.peak_allocated_bytes,
        "predicted_reserved": predicted.peak_reserved_bytes,
        "measured_allocated": measured.peak_allocated_bytes,
        "measured_reserved": measured.peak_reserved_bytes,
        "allocated_error": relative_error(
            predicted.peak_allocated_bytes, measured.peak_allocated_bytes
        ),
        "reserved_error": relative_error(
            predicted.peak_reserved_bytes, measured.peak_reserved_bytes
        ),
        "samples_per_s": result.samples_per_s,
        "prior_slowdown": prior,
    }


def with_slowdowns(cases: list[dict[str, Any]]) -> None:
    """Each case's measured step time relative to its task's as-asked run."""
    asked = {c["task"]: c.get("samples_per_s") for c in cases if c["plan"] == "as asked"}
    for case in cases:
        speed, base = case.get("samples_per_s"), asked.get(case["task"])
        case["measured_slowdown"] = base / speed if speed and base else None


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def render(result: dict[str, Any]) -> str:
    """The markdown report: one row per (task, plan)."""
    lines = [
        "# The offload rungs on a real card",
        "",
        f"{result['started']} · {result['device']} · torch {result['torch']}"
        f" · load average {result['load']}",
        "",
        "| task | plan | predicted MiB | measured MiB | allocated error | reserved error "
        "| slowdown measured | prior |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in result["cases"]:
        if "error" in case:
            lines.append(f"| {case['task']} | {case['plan']} | failed: {case['error']} |||||| ")
            continue
        measured = case["measured_slowdown"]
        lines.append(
            f"| {case['task']} | {case['plan']} | {mib(case['predicted_allocated'])} | "
            f"{mib(case['measured_allocated'])} | {percent(case['allocated_error'])} | "
            f"{percent(case['reserved_error'])} | "
            f"{'-' if measured is None else f'{measured:.2f}x'} | {case['prior_slowdown']:.2f}x |"
        )
    lines += [
        "",
        "Predicted: the worker's trace on fake cuda (host copies on fake cpu, not counted). "
        "Measured: `torch.cuda.max_memory_allocated` / `max_memory_reserved` over "
        f"{BUDGET.max_steps} steps of the worker's loop. Slowdown: as-asked samples/s over the "
        "plan's; prior: the step-time model's before any run (vramtune/common/step_time.py).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_offload: no CUDA device visible; the offload rungs need one")
    card = gpu_card()
    result: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "load": Path("/proc/loadavg").read_text().split()[0],
        "cases": [],
    }
    for task, config in families():
        for name, plan in PLANS.items():
            try:
                case = one_case(task, config, name, plan, card)
            except Exception as error:  # one failed case must not hide the others
                case = {
                    "task": task.name,
                    "plan": name,
                    "error": f"{type(error).__name__}: {error}"[:300],
                }
            result["cases"].append(case)
    with_slowdowns([c for c in result["cases"] if "error" not in c])
    write_report(args.out, "gpu_offload", result, render(result))


if __name__ == "__main__":
    main()
