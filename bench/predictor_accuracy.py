"""Predictor accuracy on a model zoo: predicted peak memory against what a real run measures.

Eleven architectures (bench/zoo), two batch sizes each, as asked / activation checkpointing /
bf16 autocast, and half micro-batches with accumulation at the larger batch.

- CPU mode (default, runs anywhere): the fake-cpu prediction against the real CPU run's tracked
  peak (the simulated card's measure; they must agree to the byte), what the CUDA emulation
  (fake cpu with CUDA's kernel choices, foreach AdamW, CUDA autocast policy, allocator model)
  predicts instead, and prediction time beside the real step time.
- GPU mode (``--gpu``, on a CUDA build with a device): the fake-cuda prediction (and the
  emulated one) against ``max_memory_allocated``, ``max_memory_reserved`` and NVML's process
  peak over three real steps: median and max relative error, the under-prediction rate, the
  rate left after a leave-one-out calibration, and prediction time beside the real step time.
  Sized to finish in under five minutes on one H200 (``--budget-s`` bounds the case loop).

Writes ``predictor_accuracy.{md,json}`` (CPU) or ``predictor_accuracy_gpu.{md,json}`` (GPU)
under ``--out`` (default bench/results/).

Usage: ``python bench/predictor_accuracy.py`` · ``python bench/predictor_accuracy.py --gpu``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.zoo import ZOO, ZooTask  # noqa: E402
from vramtune.common.memory import calibrated_bytes  # noqa: E402
from vramtune.service.calibration import fit_calibration  # noqa: E402
from vramtune.service.wire import CardInfo, Plan, Prediction  # noqa: E402
from vramtune.worker.device.memory import MemoryTracker  # noqa: E402
from vramtune.worker.predictor import (  # noqa: E402
    EMULATED_CUDA_TARGET,
    clear_cache,
    measure_card_constants,
    predict,
)
from vramtune.worker.trial.runner import CardSpec, plan_for_micro_batch  # noqa: E402
from vramtune.worker.trial.steps import batch_feeder, build_for_plan, train_step  # noqa: E402

MiB = 2**20
EMULATE = [True]
"""Also predict with the CUDA emulation (off for --families, to keep the CPU time bounded)."""
REAL_STEPS_CPU = 2
REAL_STEPS_GPU = 3


@dataclass
class Case:
    """One measurement: an architecture at a batch size under a plan."""

    task: ZooTask
    config: dict[str, Any]
    batch: int
    plan_name: str
    plan: Plan

    @property
    def label(self) -> str:
        """'gpt B8 bf16'."""
        return f"{self.task.name} B{self.batch} {self.plan_name}"


def cases(gpu: bool) -> list[Case]:
    """Every case, plain runs of every architecture first (the budget may cut the tail)."""
    stages: list[list[Case]] = [[], [], [], []]
    for task in ZOO:
        shapes = task.gpu if gpu else task.cpu
        small, large = task.gpu_batches if gpu else task.cpu_batches
        for batch in (small, large):
            config = {**shapes, "batch_size": batch}
            stages[0].append(Case(task, config, batch, "as asked", Plan()))
            stages[1].append(Case(task, config, batch, "bf16", Plan(bf16=True)))
            if task.checkpoint_modules(_meta(task, shapes)):
                stages[2].append(
                    Case(task, config, batch, "checkpointing", Plan(checkpointing=True))
                )
        config = {**shapes, "batch_size": large}
        stages[3].append(
            Case(task, config, large, "micro-batch/2", plan_for_micro_batch(large, large // 2))
        )
    return [case for stage in stages for case in stage]


# Model families (vramtune/worker/tasks/hf.py, timm_image.py, vision.py) at CPU-sized shapes: GPT-2
# 124M keeps its 12 x 768 shape and 50,257-token vocabulary but runs 64-token windows; the
# image models run at 64 px, batches 8 and 32. Each as asked, checkpointing and bf16.
FAMILIES: list[tuple[str, str, dict[str, Any], tuple[int, int]]] = [
    ("gpt2-124m", "hf-causal-lm", {"model_type": "gpt2", "num_hidden_layers": 12,
     "hidden_size": 768, "num_attention_heads": 12, "vocab_size": 50257, "seq_len": 64}, (1, 8)),
    ("gpt2-small", "hf-causal-lm", {"model_type": "gpt2", "num_hidden_layers": 2,
     "hidden_size": 128, "num_attention_heads": 4, "seq_len": 64}, (2, 8)),
    ("llama-gqa", "hf-causal-lm", {"model_type": "llama", "num_hidden_layers": 4,
     "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
     "intermediate_size": 688, "seq_len": 64}, (2, 8)),
    ("resnet50", "timm-image", {"model_name": "resnet50", "resolution": 64}, (8, 32)),
    ("vit_small_patch16_224", "timm-image",
     {"model_name": "vit_small_patch16_224", "resolution": 64}, (8, 32)),
    ("convnext_tiny", "timm-image", {"model_name": "convnext_tiny", "resolution": 64}, (8, 32)),
    ("efficientnet_b0", "timm-image", {"model_name": "efficientnet_b0", "resolution": 64}, (8, 32)),
    ("tv-mobilenet_v3_large", "torchvision-image",
     {"model_name": "mobilenet_v3_large", "resolution": 64}, (8, 32)),
]  # fmt: skip


@dataclass
class _Named:
    """A family task under the case's architecture name (the report's first column)."""

    name: str
    task: Any

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.task, attribute)


def family_cases() -> tuple[list[Case], dict[str, str]]:
    """The family cases whose library imports here, and why the others were left out."""
    from vramtune.worker.tasks.registry import discover

    found = discover()
    selected, missing = [], {}
    for label, task_name, shapes, batches in FAMILIES:
        runner = found.runners.get(task_name)
        if runner is None:
            missing[label] = found.unavailable.get(task_name) or found.errors.get(task_name, "")
            continue
        task: Any = _Named(label, runner.task)  # type: ignore[attr-defined]
        for batch in batches:
            config = {**shapes, "batch_size": batch}
            if task_name == "hf-causal-lm":
                config["corpus_chars"] = 100_000  # a tenth of the default: read faster
            for plan_name, plan in (
                ("as asked", Plan()),
                ("checkpointing", Plan(checkpointing=True)),
                ("bf16", Plan(bf16=True)),
            ):
                selected.append(Case(task, config, batch, plan_name, plan))
    return selected, missing


def _meta(task: ZooTask, shapes: dict[str, Any]) -> torch.nn.Module:
    """The model on the meta device (no memory), to ask which blocks it has."""
    with torch.device("meta"):
        return task.build_model(shapes)


def _steps(
    case: Case, device: torch.device, steps: int, after_step: Callable[[], None]
) -> list[float]:
    """Real training steps through the trainer's code path; seconds per step."""
    task, config, plan = case.task, case.config, case.plan
    micro = plan.micro_batch or case.batch
    next_batch = batch_feeder(task.batches(config, micro, device, seed=0))
    model = build_for_plan(task, config, plan, device)
    optimizer = task.build_optimizer(model, config)
    seconds = []
    loss = None
    for _ in range(steps):
        started = time.perf_counter()
        loss = train_step(task, model, optimizer, next_batch, case.batch, plan, device)
        after_step()
        seconds.append(time.perf_counter() - started)
    del loss, model, optimizer
    return seconds


def _timed_predict(case: Case, card: CardSpec | None, **kwargs: Any) -> tuple[Prediction, float]:
    """A fresh (uncached) prediction and the CPU seconds it took."""
    clear_cache()
    started = time.process_time()
    prediction = predict(case.task, case.config, case.plan, card, **kwargs)
    return prediction, time.process_time() - started


# ---------------------------------------------------------------- CPU mode


@dataclass
class CpuRow:
    """One CPU-mode case."""

    case: str
    architecture: str
    batch: int
    plan: str
    measured_bytes: int
    predicted_bytes: int
    exact: bool
    method: str
    emulated_allocated_bytes: int
    emulated_reserved_bytes: int
    emulation_change: float
    predict_s: float
    predict_cpu_s: float
    emulated_predict_s: float
    real_step_s: float
    breakdown: dict[str, int] = field(default_factory=dict)


def measure_cpu(case: Case) -> tuple[int, list[float]]:
    """The real CPU run's tracked peak (live tensor bytes) over `REAL_STEPS_CPU` training steps
    through the trainer's code path, and each step's seconds."""
    device = torch.device("cpu")
    case.task.batches(case.config, 1, device, seed=0)  # load a task's data before measuring
    tracker = MemoryTracker(device_type="cpu")
    with tracker:
        step_seconds = _steps(case, device, REAL_STEPS_CPU, lambda: None)
    return tracker.peak_bytes, step_seconds


def run_cpu_case(case: Case) -> CpuRow:
    """Real CPU run (tracked) against the fake-cpu and the emulated-CUDA predictions."""
    measured, step_seconds = measure_cpu(case)
    prediction, cpu_s = _timed_predict(case, None)
    emulated, _ = (
        _timed_predict(case, None, target=EMULATED_CUDA_TARGET) if EMULATE[0] else (prediction, 0)
    )
    return CpuRow(
        case=case.label,
        architecture=case.task.name,
        batch=case.batch,
        plan=case.plan_name,
        measured_bytes=measured,
        predicted_bytes=prediction.peak_allocated_bytes,
        exact=prediction.peak_allocated_bytes == measured,
        method=prediction.method,
        emulated_allocated_bytes=emulated.peak_allocated_bytes,
        emulated_reserved_bytes=emulated.peak_reserved_bytes,
        emulation_change=emulated.peak_allocated_bytes / max(prediction.peak_allocated_bytes, 1)
        - 1,
        predict_s=prediction.seconds,
        predict_cpu_s=cpu_s,
        emulated_predict_s=emulated.seconds,
        real_step_s=step_seconds[-1],
        breakdown=prediction.breakdown,
    )


def cpu_summary(rows: list[CpuRow]) -> dict[str, Any]:
    """Exact matches, the emulation's effect, prediction vs step time."""
    traced = [r for r in rows if r.method == "trace"]
    changes = [r.emulation_change for r in traced]
    return {
        "cases": len(rows),
        "traced": len(traced),
        "exact": sum(r.exact for r in traced),
        "max_abs_difference_bytes": max(
            (abs(r.predicted_bytes - r.measured_bytes) for r in traced), default=0
        ),
        "max_relative_difference": max(
            (abs(r.predicted_bytes - r.measured_bytes) / max(r.measured_bytes, 1) for r in traced),
            default=0.0,
        ),
        "under_predicted": sum(r.predicted_bytes < r.measured_bytes for r in traced),
        "emulation_change_median": _median(changes),
        "emulation_change_min": min(changes, default=0.0),
        "emulation_change_max": max(changes, default=0.0),
        "predict_s_median": _median([r.predict_s for r in rows]),
        "predict_cpu_s_median": _median([r.predict_cpu_s for r in rows]),
        "real_step_s_median": _median([r.real_step_s for r in rows]),
    }


# ---------------------------------------------------------------- GPU mode


@dataclass
class GpuRow:
    """One GPU-mode case."""

    case: str
    architecture: str
    batch: int
    plan: str
    method: str
    predicted_allocated_bytes: int
    predicted_reserved_bytes: int
    predicted_nvml_bytes: int
    emulated_allocated_bytes: int
    emulated_reserved_bytes: int
    measured_allocated_bytes: int
    measured_reserved_bytes: int
    measured_nvml_bytes: int | None
    error_allocated: float
    error_reserved: float
    error_nvml: float | None
    emulated_error_allocated: float
    emulated_error_reserved: float
    predict_s: float
    predict_cpu_s: float
    real_step_s: float
    reason: str = ""


def gpu_card(device: torch.device) -> CardSpec:
    """This card with its constants measured now, as a worker registers it."""
    constants = measure_card_constants(device)
    free, total = torch.cuda.mem_get_info(device)
    info = CardInfo(
        model=torch.cuda.get_device_name(device),
        total_bytes=total,
        free_bytes=free,
        device_index=device.index or 0,
        torch_version=torch.__version__,
    )
    return CardSpec(info=info, constants=constants.model_dump(), device=str(device))


def _nvml_used(device: torch.device) -> int | None:
    try:
        from vramtune.worker.device.gpu import process_used_bytes
    except ImportError:
        return None
    return process_used_bytes(device.index or 0)


def measure_cuda(case: Case, device: torch.device) -> tuple[int, int, int | None, float]:
    """(max allocated, max reserved, NVML peak, seconds of the last step) of real steps."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    nvml: list[int] = []

    def sample() -> None:
        torch.cuda.synchronize(device)
        used = _nvml_used(device)
        if used is not None:
            nvml.append(used)

    seconds = _steps(case, device, REAL_STEPS_GPU, sample)
    peaks = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    gc.collect()
    torch.cuda.empty_cache()
    return peaks[0], peaks[1], max(nvml) if nvml else None, seconds[-1]


def run_gpu_case(case: Case, card: CardSpec, device: torch.device) -> GpuRow:
    """Fake-cuda and emulated predictions against three real steps on the card."""
    prediction, cpu_s = _timed_predict(case, card)
    emulated, _ = _timed_predict(case, card, target=EMULATED_CUDA_TARGET)
    allocated, reserved, nvml, step_s = measure_cuda(case, device)
    context = int(card.constants.get("cuda_context_bytes", 0))
    nvml_predicted = prediction.peak_reserved_bytes + context
    return GpuRow(
        case=case.label,
        architecture=case.task.name,
        batch=case.batch,
        plan=case.plan_name,
        method=prediction.method,
        predicted_allocated_bytes=prediction.peak_allocated_bytes,
        predicted_reserved_bytes=prediction.peak_reserved_bytes,
        predicted_nvml_bytes=nvml_predicted,
        emulated_allocated_bytes=emulated.peak_allocated_bytes,
        emulated_reserved_bytes=emulated.peak_reserved_bytes,
        measured_allocated_bytes=allocated,
        measured_reserved_bytes=reserved,
        measured_nvml_bytes=nvml,
        error_allocated=_error(prediction.peak_allocated_bytes, allocated),
        error_reserved=_error(prediction.peak_reserved_bytes, reserved),
        error_nvml=None if nvml is None else _error(nvml_predicted, nvml),
        emulated_error_allocated=_error(emulated.peak_allocated_bytes, allocated),
        emulated_error_reserved=_error(emulated.peak_reserved_bytes, reserved),
        predict_s=prediction.seconds,
        predict_cpu_s=cpu_s,
        real_step_s=step_s,
        reason=prediction.reason,
    )


def _error(predicted: int, measured: int) -> float:
    """Relative error: negative is an under-prediction."""
    return (predicted - measured) / max(measured, 1)


def _errors(values: list[float]) -> dict[str, float]:
    return {
        "median_abs": _median([abs(v) for v in values]),
        "max_abs": max((abs(v) for v in values), default=0.0),
        "under_rate": sum(v < 0 for v in values) / len(values) if values else 0.0,
    }


def loo_under_rate(rows: list[GpuRow], per_architecture: bool) -> float:
    """Runs exceeding their calibrated footprint when calibrated on every other run."""
    misses = 0
    for i, row in enumerate(rows):
        others = [
            (r.predicted_reserved_bytes, max(r.measured_reserved_bytes, r.measured_allocated_bytes))
            for j, r in enumerate(rows)
            if j != i and (not per_architecture or r.architecture == row.architecture)
        ]
        calibration = fit_calibration("card", torch.__version__, row.architecture, others)
        measured = max(row.measured_reserved_bytes, row.measured_allocated_bytes)
        misses += measured > calibrated_bytes(row.predicted_reserved_bytes, calibration)
    return misses / len(rows) if rows else 0.0


def gpu_summary(rows: list[GpuRow]) -> dict[str, Any]:
    """Error statistics, calibrated under-prediction rates, prediction vs step time."""
    gpt = [r for r in rows if r.architecture == "gpt" and r.plan == "as asked"]
    nvml = [r.error_nvml for r in rows if r.error_nvml is not None]
    return {
        "cases": len(rows),
        "traced": sum(r.method == "trace" for r in rows),
        "allocated": _errors([r.error_allocated for r in rows]),
        "reserved": _errors([r.error_reserved for r in rows]),
        "nvml": _errors(nvml) if nvml else None,
        "emulated_allocated": _errors([r.emulated_error_allocated for r in rows]),
        "emulated_reserved": _errors([r.emulated_error_reserved for r in rows]),
        "loo_calibrated_under_rate_per_architecture": loo_under_rate(rows, per_architecture=True),
        "loo_calibrated_under_rate_pooled": loo_under_rate(rows, per_architecture=False),
        "predict_s_median": _median([r.predict_s for r in rows]),
        "real_step_s_median": _median([r.real_step_s for r in rows]),
        "gpt12_predict_s": [round(r.predict_s, 3) for r in gpt],
    }


# ---------------------------------------------------------------- output


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _mib(nbytes: int | None) -> str:
    return "—" if nbytes is None else f"{nbytes / MiB:,.1f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:+.2f} %"


def environment() -> dict[str, Any]:
    """Where the benchmark ran."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1m": round(load[0], 2),
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def cpu_markdown(
    env: dict[str, Any],
    summary: dict[str, Any],
    rows: list[CpuRow],
    skipped: int,
    failed: dict[str, str],
) -> str:
    """The CPU-mode report."""
    left_out = f"; {skipped} cases left out by the time budget" if skipped else ""
    lines = [
        "# Predictor accuracy — CPU mode",
        "",
        f"{env['date']} · torch {env['torch']} · {env['cpus']} CPUs · load average "
        f"{env['load_average_1m']} at the end · `python bench/predictor_accuracy.py`",
        "",
        "Fake-cpu prediction vs the real CPU run's tracked peak (live tensor bytes, 512-byte "
        "rounding, two training steps through `vramtune.worker.trial.steps.train_step`), and the "
        "emulated-CUDA "
        "prediction (fake cpu with CUDA kernel choices, foreach AdamW, the CUDA autocast "
        "policy and the caching-allocator model; card constants zero).",
        "",
        f"- cases: {summary['cases']} ({summary['traced']} traced); exact to the byte: "
        f"**{summary['exact']} / {summary['traced']}**; largest difference "
        f"{summary['max_abs_difference_bytes']} bytes "
        f"({100 * summary['max_relative_difference']:.3f} %), under-predicted "
        f"{summary['under_predicted']}{left_out}",
        f"- CUDA emulation vs fake cpu (allocated): median "
        f"{_pct(summary['emulation_change_median'])}, range "
        f"{_pct(summary['emulation_change_min'])} to {_pct(summary['emulation_change_max'])}",
        f"- prediction: median {summary['predict_s_median']:.2f} s wall, "
        f"{summary['predict_cpu_s_median']:.2f} s CPU; real step: median "
        f"{summary['real_step_s_median']:.3f} s",
        "",
        "| case | measured MiB | predicted MiB | exact | emulated CUDA alloc / reserved MiB "
        "| emulation | predict s | step s |",
        "|---|---:|---:|:---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.case} | {_mib(r.measured_bytes)} | {_mib(r.predicted_bytes)} | "
            f"{'yes' if r.exact else 'NO'} | {_mib(r.emulated_allocated_bytes)} / "
            f"{_mib(r.emulated_reserved_bytes)} | {_pct(r.emulation_change)} | "
            f"{r.predict_s:.2f} | {r.real_step_s:.3f} |"
        )
    return "\n".join(lines + _failures(failed)) + "\n"


def _failures(failed: dict[str, str]) -> list[str]:
    if not failed:
        return []
    lines = ["", "Cases whose real run failed (nothing to compare):", ""]
    return lines + [f"- {label}: {why}" for label, why in failed.items()]


def _stats_row(summary: dict[str, Any], name: str) -> str:
    stats = summary[name]
    if stats is None:
        return f"| {name} | — | — | — |"
    return (
        f"| {name} | {100 * stats['median_abs']:.2f} % | {100 * stats['max_abs']:.2f} % "
        f"| {100 * stats['under_rate']:.1f} % |"
    )


def _gpu_case_row(r: GpuRow) -> str:
    method = "" if r.method == "trace" else f" ({r.method})"
    pairs = [
        (r.predicted_allocated_bytes, r.measured_allocated_bytes, r.error_allocated),
        (r.predicted_reserved_bytes, r.measured_reserved_bytes, r.error_reserved),
        (r.predicted_nvml_bytes, r.measured_nvml_bytes, r.error_nvml),
    ]
    cells = [f"{_mib(p)} / {_mib(m)} | {_pct(e)}" for p, m, e in pairs]
    return (
        f"| {r.case}{method} | {' | '.join(cells)} | {_pct(r.emulated_error_allocated)} | "
        f"{r.predict_s:.2f} | {r.real_step_s:.3f} |"
    )


def gpu_markdown(
    env: dict[str, Any],
    summary: dict[str, Any],
    rows: list[GpuRow],
    card: CardSpec,
    skipped: int,
    failed: dict[str, str],
) -> str:
    """The GPU-mode report."""
    left_out = f"; {skipped} left out by the time budget" if skipped else ""
    per_arch = summary["loo_calibrated_under_rate_per_architecture"]
    pooled = summary["loo_calibrated_under_rate_pooled"]
    lines = [
        "# Predictor accuracy — GPU mode",
        "",
        f"{env['date']} · {env['cuda_device']} · torch {env['torch']} · "
        "`python bench/predictor_accuracy.py --gpu`",
        "",
        f"Card constants: {json.dumps(card.constants)}. Measured over {REAL_STEPS_GPU} real "
        "steps; predicted from a two-step fake-cuda trace (and, for comparison, the CPU-build "
        "emulation).",
        "",
        f"- cases: {summary['cases']} ({summary['traced']} traced){left_out}",
        f"- under-predictions after a leave-one-out calibration: per architecture "
        f"{100 * per_arch:.1f} %, pooled {100 * pooled:.1f} %",
        f"- prediction: median {summary['predict_s_median']:.2f} s; 12-layer GPT "
        f"{summary['gpt12_predict_s']} s; real step median {summary['real_step_s_median']:.3f} s",
        "",
        "| vs | median abs error | max abs error | under-predicted |",
        "|---|---:|---:|---:|",
        *(
            _stats_row(summary, name)
            for name in ("allocated", "reserved", "nvml", "emulated_allocated", "emulated_reserved")
        ),
        "",
        "| case | alloc pred / meas MiB | err | reserved pred / meas MiB | err "
        "| NVML pred / meas MiB | err | emulated alloc err | predict s | step s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(_gpu_case_row(r) for r in rows),
    ]
    return "\n".join(lines + _failures(failed)) + "\n"


def _within_budget(all_cases: list[Case], budget_s: float) -> Iterator[Case]:
    started = time.monotonic()
    for case in all_cases:
        if time.monotonic() - started > budget_s:
            return
        yield case


def main(argv: list[str] | None = None) -> int:
    """Run the chosen mode and write its markdown and JSON."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpu", action="store_true", help="GPU mode (needs a CUDA device)")
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results", help="results folder"
    )
    parser.add_argument(
        "--budget-s", type=float, default=None, help="stop starting cases after this long"
    )
    parser.add_argument("--only", default="", help="comma-separated architectures to run")
    parser.add_argument(
        "--families", action="store_true", help="the HF/timm/torchvision families, not the zoo"
    )
    args = parser.parse_args(argv)
    if args.gpu and not torch.cuda.is_available():
        parser.error("--gpu needs a CUDA device")
    missing: dict[str, str] = {}
    if args.families:
        every, missing = family_cases()
        EMULATE[0] = False
    else:
        every = cases(args.gpu)
    selected = [c for c in every if not args.only or c.task.name in args.only.split(",")]
    budget = args.budget_s if args.budget_s is not None else (210.0 if args.gpu else 540.0)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.gpu:
        return _gpu_mode(selected, budget, args.out)
    stem = "predictor_accuracy_families" if args.families else "predictor_accuracy"
    return _cpu_mode(selected, budget, args.out / stem, missing)


def _run_all(
    selected: list[Case], budget: float, run: Callable[[Case], Any]
) -> tuple[list[Any], dict[str, str], int]:
    """Rows of the cases that ran, the ones whose real run failed (why), how many were left."""
    rows, failed, attempted = [], {}, 0
    for case in _within_budget(selected, budget):
        attempted += 1
        try:
            rows.append(run(case))
        except Exception as error:  # a real run torch refuses (e.g. bf16 LSTM on this CPU)
            failed[case.label] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            print(f"{case.label:45s} FAILED {failed[case.label]}", flush=True)
            continue
        print(f"{case.label:45s} {_progress(rows[-1])}", flush=True)
    return rows, failed, len(selected) - attempted


def _progress(row: CpuRow | GpuRow) -> str:
    if isinstance(row, CpuRow):
        return f"{row.measured_bytes / MiB:9.2f} MiB exact={row.exact} {row.method}"
    return f"alloc {_pct(row.error_allocated)} reserved {_pct(row.error_reserved)} {row.method}"


def _cpu_mode(selected: list[Case], budget: float, stem: Path, missing: dict[str, str]) -> int:
    rows, failed, skipped = _run_all(selected, budget, run_cpu_case)
    summary = cpu_summary(rows)
    env = environment()
    payload: dict[str, Any] = {"environment": env, "summary": summary, "skipped": skipped}
    payload |= {"failed": failed, "not_importable": missing}
    payload["rows"] = [asdict(r) for r in rows]
    markdown = cpu_markdown(env, summary, rows, skipped, failed)
    markdown += "".join(f"\n- not run, {name}: {why}" for name, why in missing.items())
    _write(stem, markdown, payload)
    return 0 if summary["exact"] == summary["traced"] else 1


def _gpu_mode(selected: list[Case], budget: float, out: Path) -> int:
    device = torch.device("cuda", 0)
    card = gpu_card(device)
    rows, failed, skipped = _run_all(
        selected, budget, lambda case: run_gpu_case(case, card, device)
    )
    summary = gpu_summary(rows)
    env = environment()
    payload: dict[str, Any] = {"environment": env, "card_constants": card.constants}
    payload["summary"] = summary
    payload |= {"skipped": skipped, "failed": failed, "rows": [asdict(r) for r in rows]}
    markdown = gpu_markdown(env, summary, rows, card, skipped, failed)
    _write(out / "predictor_accuracy_gpu", markdown, payload)
    return 0


def _write(stem: Path, markdown: str, payload: dict[str, Any]) -> None:
    stem.with_suffix(".md").write_text(markdown)
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {stem}.md and {stem}.json")


if __name__ == "__main__":
    raise SystemExit(main())
