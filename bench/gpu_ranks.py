"""Per-rank prediction against real NCCL ranks on GPUs (issue 31, the GPU path).

On a machine with 2 or more CUDA GPUs: for world sizes 2 and 4 (as many as it has), hf-causal-lm
(a tiny Llama from its config) and digits-cnn, DDP, FSDP2 and FSDP2 keeping its parameters
gathered after forward (`reshard_after_forward=False`), one global batch each, this runs
the product's own distributed trial (`worker.run.ranks.RankGroupRunner` on `cuda:0..W-1`: one
process per card, `CUDA_VISIBLE_DEVICES` per rank, NCCL), which measures every rank's
`torch.cuda.max_memory_allocated` / `max_memory_reserved`, and compares each with the per-rank
prediction the worker makes before launching it (`vramtune.worker.predictor.distributed.trace_rank`,
rank 0 on a fake process group). The CPU trace does not see CUDA's kernel choices (SDPA,
dropout masks) or the NCCL buffers, so this is where the per-rank gap on real cards is
measured; on CPU ranks (gloo) the same prediction is exact (bench/distributed_prediction.py).

    python bench/gpu_ranks.py --out DIR     # writes DIR/gpu_ranks.{md,json}

Without 2 CUDA devices it says so and exits with status 2, writing nothing. bench/gpu_check.sh
runs it as its last step.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.distributed_prediction import wrapper  # noqa: E402
from bench.gpu_common import HF_CONFIG, Quiet, percent, relative_error  # noqa: E402
from bench.report import write_report  # noqa: E402
from vramtune.service.wire import Plan, Strategy, TrainBudget  # noqa: E402
from vramtune.worker.trial.runner import CardSpec  # noqa: E402
from vramtune.worker.trial.task import Config, Task  # noqa: E402

WORLD_SIZES = (2, 4)
WRAPPERS: tuple[tuple[Strategy, bool], ...] = (("ddp", True), ("fsdp", True), ("fsdp", False))
"""Each strategy with its reshard_after_forward: FSDP2 both ways, as the plan ladder runs it."""
BUDGET = TrainBudget(max_steps=3, eval_every=3)
CNN_CONFIG: Config = {"width": 32, "depth": 3, "resolution": 64, "batch_size": 64, "lr": 0.05}


def families() -> list[tuple[Task, Config]]:
    """The task families run: a decoder (one `fully_shard` per layer) and a CNN."""
    from vramtune.worker.tasks.digits import DigitsCNNTask
    from vramtune.worker.tasks.hf import HFCausalLMTask

    return [(HFCausalLMTask(), HF_CONFIG), (DigitsCNNTask(), CNN_CONFIG)]


def gpu_card(device: str) -> CardSpec:
    """The card behind a CUDA device, as a worker started with `--devices` sees it."""
    from vramtune.worker.device.gpu import card_for_device

    return CardSpec(info=card_for_device(device), device=device)


def one_case(
    task: Task,
    config: Config,
    strategy: Strategy,
    devices: list[str],
    card: CardSpec,
    reshard_after_forward: bool = True,
) -> dict[str, Any]:
    """One distributed trial on `devices` (one rank each) against its per-rank prediction;
    `reshard_after_forward=False`: FSDP2 keeping each unit's parameters gathered."""
    from vramtune.worker.predictor.distributed import trace_rank
    from vramtune.worker.run.ranks import RankGroupRunner
    from vramtune.worker.run.training import TorchTaskRunner

    world_size = len(devices)
    plan = Plan(
        world_size=world_size, strategy=strategy, reshard_after_forward=reshard_after_forward
    )
    predicted = trace_rank(task, config, plan, strategy, world_size)
    started = time.perf_counter()
    result = RankGroupRunner(TorchTaskRunner(task), devices).run(
        config, plan, BUDGET, card, Quiet()
    )
    peaks = result.measured.rank_peak_bytes or [result.measured.peak_allocated_bytes]
    return {
        "task": task.name,
        "strategy": strategy,
        "reshard_after_forward": reshard_after_forward,
        "world_size": world_size,
        "batch_size": config["batch_size"],
        "predicted_allocated": predicted.allocated_bytes,
        "predicted_reserved": predicted.reserved_bytes,
        "measured_allocated": peaks,
        "measured_reserved_largest": result.measured.peak_reserved_bytes,
        "allocated_error": [relative_error(predicted.allocated_bytes, p) for p in peaks],
        "reserved_error": relative_error(
            predicted.reserved_bytes, result.measured.peak_reserved_bytes
        ),
        "trace_s": predicted.seconds,
        "run_s": time.perf_counter() - started,
    }


def render(result: dict[str, Any]) -> str:
    """The markdown report: one row per case, every rank's error."""
    lines = [
        "# Per-rank prediction against NCCL ranks on GPUs",
        "",
        f"{result['started']} · {result['device']} × {result['gpus']} · torch {result['torch']}"
        f" · load average {result['load']}",
        "",
        "| task | strategy | W | batch | predicted / rank | measured per rank | allocated error "
        "per rank | reserved error (largest rank) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in result["cases"]:
        if "error" in case:
            lines.append(
                f"| {case['task']} | {wrapper(case)} | {case['world_size']} | | "
                f"failed: {case['error']} | | | |"
            )
            continue
        measured = ", ".join(f"{p / 2**20:.1f}" for p in case["measured_allocated"])
        errors = ", ".join(percent(e) for e in case["allocated_error"])
        lines.append(
            f"| {case['task']} | {wrapper(case)} | {case['world_size']} | "
            f"{case['batch_size']} | {case['predicted_allocated'] / 2**20:.1f} MiB | "
            f"{measured} MiB | {errors} | {percent(case['reserved_error'])} |"
        )
    lines += [
        "",
        "Predicted: rank 0 traced on a fake process group (the CPU trace the worker uses before "
        "launching the ranks). Measured: each rank's `torch.cuda.max_memory_allocated`; "
        "reserved: the largest rank's `max_memory_reserved`.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        sys.exit(f"gpu_ranks: {gpus} CUDA device(s) visible; per-rank runs need 2 or more")
    result: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "gpus": gpus,
        "torch": torch.__version__,
        "load": Path("/proc/loadavg").read_text().split()[0],
        "cases": [],
    }
    for world_size in (size for size in WORLD_SIZES if size <= gpus):
        for task, config in families():
            for strategy, reshard in WRAPPERS:
                devices = [f"cuda:{index}" for index in range(world_size)]
                try:
                    card = gpu_card(devices[0])
                    case = one_case(task, config, strategy, devices, card, reshard)
                except Exception as error:  # one failed case must not hide the others
                    case = {
                        "task": task.name,
                        "strategy": strategy,
                        "reshard_after_forward": reshard,
                        "world_size": world_size,
                        "error": f"{type(error).__name__}: {error}"[:300],
                    }
                result["cases"].append(case)
    write_report(args.out, "gpu_ranks", result, render(result))


if __name__ == "__main__":
    main()
