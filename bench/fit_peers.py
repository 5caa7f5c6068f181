"""Will it fit? `vramtune.fit` side by side with its peers, against the real CPU peak.

Every architecture of the zoo (bench/zoo: MLP, CNN + BatchNorm, ResNet-18, U-Net, LSTM, GRU,
Transformer encoder, a GPT with its own SDPA attention and a tied head, ViT, tied autoencoder,
dropout everywhere) and its three extras (frozen stages, peft's LoRA on the GPT, a model of two
inputs), at the zoo's two CPU batch sizes, as asked (fp32, AdamW): one training step's peak
predicted by each tool, against the real CPU run's tracked peak of the same step
(`bench.predictor_accuracy.measure_cpu`: live tensor bytes over two steps through the trainer's
`train_step`, the measure predictor_accuracy uses).

What is compared:

- vramtune: ``vramtune.fit(task, config=..., device="cpu", cards=[])``'s ``peak_bytes`` (the CPU
  run's own peak of live tensor bytes; no card asked about, so no plan is searched). The
  predictor's cache is cleared before each case: every figure is a first prediction, the
  model's build included.
- torch-kitsune: ``kitsune.predict.predict_memory(model, input_shape, batch_size, optimizer=
  "adamw", training=True)``'s tensor part: parameters + gradients + optimizer state +
  activations, without the 15 % it adds for the CUDA allocator's overhead (``overhead_bytes``,
  recorded in the JSON), for every case; for the LoRA case its own ``estimate_lora_memory`` on
  the base model is noted beside it. It takes one input shape and feeds ``torch.randn`` of it:
  a model of two inputs gets the first input's shape, a token model float noise; when its
  forward passes fail it falls back to per-layer formulas (the paths that failed are noted per
  case).
- vram-check: ``vram_check.analyze(model, batch_size, dtype="fp32", optimizer="adamw",
  training=True)``'s ``estimate.total_bytes`` (trainable parameters x (4 + 4 + 8 bytes) and
  activations of 2 x the parameter bytes per example), plus its ``frozen["frozen_bytes"]``
  (the frozen parameters' weights, which it reports beside the estimate) when the model has any.
- accelerate: ``accelerate estimate-memory``'s "Training using Adam" rule,
  ``max(accelerate.commands.estimate.estimate_training_usage(total, "float32").values())`` =
  4 x ``total`` (weights, gradients and Adam's two moments; batch size 1 in its words, no
  activations), with ``total`` from ``accelerate.utils.calculate_maximum_sizes(model)``
  (parameter and buffer bytes). The command itself only loads Hub models: the rule is applied
  to the zoo's model directly.

Each prediction is timed (wall seconds, `time.perf_counter`) with the 1-minute load average
taken just before it. Every real run and vramtune's predictions come first; the peers are
imported only after them, so nothing they do at import reaches either. A peer that is not
installed, or raises on a model, is recorded for that case (the case stays in).

The peers are bench-only dependencies, never imported by vramtune: install them apart from the
project's environment, with the CPU torch first (a plain torch requirement pulls a CUDA build)::

    /work/main/.venv/bin/python -m venv /work/peers-venv     # or any Python >= 3.11
    /work/peers-venv/bin/pip install "torch==2.13.0"          # the CPU build, as scripts/setup.sh
    /work/peers-venv/bin/pip install -e ".[peft,bench-peers]"
    nice -n 19 /work/peers-venv/bin/python bench/fit_peers.py

Writes ``fit_peers.{md,json}`` under ``--out`` (default bench/results/). ``--quick`` runs the
smaller batch only; ``--only mlp,gpt-lora`` some architectures.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.predictor_accuracy import Case, measure_cpu  # noqa: E402
from bench.report import write_report  # noqa: E402
from bench.zoo import EXTRAS, ZOO  # noqa: E402
from vramtune.service.wire import Plan  # noqa: E402
from vramtune.worker.fit.api import fit  # noqa: E402
from vramtune.worker.predictor import clear_cache  # noqa: E402

MiB = 2**20
WITHIN = 0.25
"""The error a prediction may have to count as "within" (the issue's 25 %)."""
PEERS = {"torch-kitsune": "kitsune", "vram-check": "vram_check", "accelerate": "accelerate"}
"""Each peer's distribution name and the module it is imported by."""
TOOLS = ["vramtune", *PEERS]
COMPARED = {
    "vramtune": "`fit(..., device='cpu').peak_bytes`: the CPU run's peak of live tensor bytes",
    "torch-kitsune": "`predict_memory(...)` tensor part: parameters + gradients + AdamW state "
    "+ activations, without its 15 % CUDA overhead",
    "vram-check": "`analyze(...)['estimate'].total_bytes` (+ frozen weights when any)",
    "accelerate": "`estimate-memory`'s training rule: 4 x the parameter and buffer bytes",
}
REFERENCE = {
    "vramtune": "0.005 % median, 1.6 s",
    "torch-kitsune": "0.7.0: 24 % median, 0.30 s",
    "vram-check": "0.1.1: 84 % median",
    "accelerate": "54 % median",
}
"""The issue's earlier measurement on 28 cases, for reference."""


@dataclass
class Estimate:
    """One tool's prediction of one case (None: not installed, or it failed: see note)."""

    tool: str
    predicted_bytes: int | None
    seconds: float | None
    load_1m: float
    error: float | None = None
    note: str = ""
    parts: dict[str, int] = field(default_factory=dict)


@dataclass
class Row:
    """One case: the real peak and each tool's estimate."""

    case: str
    architecture: str
    batch: int
    measured_bytes: int
    real_step_s: float
    estimates: dict[str, Estimate] = field(default_factory=dict)


def fit_cases(quick: bool = False, only: str = "") -> list[Case]:
    """The zoo and its extras at their CPU shapes, the two batch sizes each (the smaller only
    with `quick`), as asked."""
    chosen = [t for t in [*ZOO, *EXTRAS] if not only or t.name in only.split(",")]
    selected = []
    for task in chosen:
        for batch in task.cpu_batches[:1] if quick else task.cpu_batches:
            config = {**task.cpu, task.batch_size_param: batch}
            selected.append(Case(task, config, batch, "as asked", Plan()))
    return selected


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _error(predicted: int | None, measured: int) -> float | None:
    """Relative error: negative is an under-prediction."""
    return None if predicted is None else (predicted - measured) / max(measured, 1)


def vramtune_estimate(case: Case) -> Estimate:
    """`vramtune.fit` on the task, CPU rules, a first (uncached) prediction."""
    clear_cache()
    load = _load()
    started = time.perf_counter()
    result = fit(case.task, config=case.config, device="cpu", cards=[])
    seconds = time.perf_counter() - started
    note = "" if result.method == "trace" else f"{result.method}: {result.reason}"
    return Estimate("vramtune", result.peak_bytes, seconds, load, note=note, parts=result.breakdown)


# ---------------------------------------------------------------- the peers


class _Messages(logging.Handler):
    """Collects a logger's records (kitsune says at debug level which estimator failed)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def kitsune(model: nn.Module, inputs: Any, batch: int) -> tuple[int, str, dict[str, int]]:
    """torch-kitsune's tensor part (its 15 % overhead left out) and the estimators that failed."""
    from kitsune.predict import predict_memory

    first = inputs[0] if isinstance(inputs, tuple) else inputs
    log = logging.getLogger("kitsune.predict.activation_estimator")
    messages, level = _Messages(), log.level
    log.addHandler(messages)
    log.setLevel(logging.DEBUG)
    try:
        result = predict_memory(
            model, tuple(first.shape[1:]), batch, torch.float32, "adamw", training=True
        )
    finally:
        log.removeHandler(messages)
        log.setLevel(level)
    failed = [m.split("]")[0].strip("[") for m in messages.lines if "failed" in m.lower()]
    notes = [f"its {' and '.join(failed)} estimators failed" if failed else ""]
    if {"fx", "meta"} <= set(failed):
        notes[0] += ": activations from its per-layer formulas"
    if isinstance(inputs, tuple):
        notes.append(f"given the first of {len(inputs)} inputs")
    parts = {
        "parameters": result.param_bytes,
        "gradients": result.gradient_bytes,
        "optimizer_state": result.optimizer_bytes,
        "activations": result.activation_bytes,
        "overhead_not_compared": result.overhead_bytes,
    }
    tensor_part = result.total_bytes - result.overhead_bytes
    return tensor_part, "; ".join(n for n in notes if n), parts


LORA_BASES = {"gpt-lora": ("gpt", 8, ("qkv", "proj", "fc", "out"))}
"""A LoRA case's base architecture, rank and target layers, for kitsune's own LoRA estimator."""


def kitsune_lora(case: Case, inputs: Any) -> int:
    """A LoRA case's figure from kitsune's `estimate_lora_memory` on the base model (its tensor
    part, like the compared one), as a note: the table keeps `predict_memory` for every case."""
    from kitsune.predict import LoRAConfig, estimate_lora_memory

    base_name, rank, targets = LORA_BASES[case.task.name]
    (base_task,) = [t for t in ZOO if t.name == base_name]
    base = base_task.build_model(case.config)
    config = LoRAConfig(rank=rank, target_modules=targets, optimizer="adamw")
    result = estimate_lora_memory(base, tuple(inputs.shape[1:]), case.batch, config=config)
    return result.total_bytes - result.overhead_bytes


def vram_check(model: nn.Module, inputs: Any, batch: int) -> tuple[int, str, dict[str, int]]:
    """vram-check's training estimate, with the frozen weights it reports beside it."""
    from vram_check import analyze

    report = analyze(model, batch_size=batch, dtype="fp32", optimizer="adamw", training=True)
    estimate = report["estimate"]
    frozen = report["frozen"]["frozen_bytes"] if report["frozen"] else 0
    parts = {
        "parameters": estimate.parameters_bytes,
        "gradients": estimate.gradients_bytes,
        "optimizer_state": estimate.optimizer_bytes,
        "activations": estimate.activations_bytes,
        "frozen_weights": frozen,
    }
    return estimate.total_bytes + frozen, "", parts


def accelerate(model: nn.Module, inputs: Any, batch: int) -> tuple[int, str, dict[str, int]]:
    """accelerate estimate-memory's "Training using Adam" on the model's own sizes."""
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    total, _ = calculate_maximum_sizes(model)
    usage = estimate_training_usage(total, "float32")
    return max(usage.values()), "", {"model_bytes": total, **usage}


PEER_CALLS: dict[str, Callable[[nn.Module, Any, int], tuple[int, str, dict[str, int]]]] = {
    "torch-kitsune": kitsune,
    "vram-check": vram_check,
    "accelerate": accelerate,
}


def versions() -> dict[str, str | None]:
    """Each tool's installed version (None: not installed)."""
    found: dict[str, str | None] = {"vramtune": metadata.version("vramtune")}
    for name in PEERS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


PEER_MODULES = {
    "torch-kitsune": ["kitsune.predict"],
    "vram-check": ["vram_check"],
    "accelerate": ["accelerate.commands.estimate", "accelerate.utils"],
}
"""What each peer's call imports: imported once before the first timed call, so that a
prediction's seconds are not its import's."""


def _import_peers(installed: dict[str, str | None]) -> dict[str, str]:
    """Import the installed peers; those that fail to import, with why."""
    broken = {}
    for name, modules in PEER_MODULES.items():
        if installed[name] is None:
            continue
        try:
            for module in modules:
                importlib.import_module(module)
        except Exception as error:  # a peer broken on this torch: recorded per case
            broken[name] = f"import failed: {type(error).__name__}: {error}"[:200]
    return broken


def peer_estimates(
    case: Case, installed: dict[str, str | None], broken: dict[str, str], measured: int
) -> dict[str, Estimate]:
    """Each peer on the case's model (built once, on the CPU) and its example batch."""
    torch.manual_seed(0)
    model = case.task.build_model(case.config)
    inputs, _ = case.task.example_batch(case.config, case.batch, torch.device("cpu"))
    found = {}
    for name, call in PEER_CALLS.items():
        load = _load()
        if installed[name] is None:
            found[name] = Estimate(name, None, None, load, note="not installed")
            continue
        if name in broken:
            found[name] = Estimate(name, None, None, load, note=broken[name])
            continue
        started = time.perf_counter()
        try:
            predicted, note, parts = call(model, inputs, case.batch)
        except Exception as error:  # a peer that cannot take this model: recorded, not fatal
            why = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"
            found[name] = Estimate(name, None, time.perf_counter() - started, load, note=why)
            continue
        found[name] = Estimate(name, predicted, time.perf_counter() - started, load, note=note)
        found[name].parts = parts
    kitsune_row = found["torch-kitsune"]
    if case.task.name in LORA_BASES and kitsune_row.predicted_bytes is not None:
        try:
            lora = kitsune_lora(case, inputs)
            kitsune_row.parts["lora_estimator_tensor_part"] = lora
            also = (
                f"its LoRA estimator (`estimate_lora_memory`, tensor part): {lora / MiB:,.2f} "
                f"MiB ({_pct(_error(lora, measured))})"
            )
        except Exception as error:  # recorded beside its predict_memory figure
            also = f"its LoRA estimator failed: {type(error).__name__}: {error}"[:200]
        kitsune_row.note = "; ".join(n for n in (kitsune_row.note, also) if n)
    return found


# ---------------------------------------------------------------- running and reporting


def run(cases: list[Case]) -> tuple[list[Row], dict[str, str]]:
    """Real runs and vramtune first (no peer imported yet), then the peers, case by case."""
    rows, failed = [], {}
    for case in cases:
        try:
            measured, steps = measure_cpu(case)
        except Exception as error:  # a real run torch refuses: nothing to compare against
            failed[case.label] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            continue
        row = Row(case.label, case.task.name, case.batch, measured, steps[-1])
        try:
            row.estimates["vramtune"] = vramtune_estimate(case)
        except Exception as error:  # recorded like a peer's failure: the case stays
            why = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]}"
            row.estimates["vramtune"] = Estimate("vramtune", None, None, _load(), note=why)
        row.estimates["vramtune"].error = _error(
            row.estimates["vramtune"].predicted_bytes, measured
        )
        rows.append(row)
        print(f"{case.label:32s} {measured / MiB:9.2f} MiB  vramtune {_cell(row, 'vramtune')}")
    installed = versions()
    broken = _import_peers(installed)
    by_label = {c.label: c for c in cases}
    for row in rows:
        row.estimates |= peer_estimates(by_label[row.case], installed, broken, row.measured_bytes)
        for estimate in row.estimates.values():
            estimate.error = _error(estimate.predicted_bytes, row.measured_bytes)
        print(f"{row.case:32s} " + " | ".join(_cell(row, t) for t in PEERS), flush=True)
    return rows, failed


def summary(rows: list[Row], installed: dict[str, str | None]) -> dict[str, dict[str, Any]]:
    """Per tool: how many cases it predicted, its errors, seconds and load."""
    found = {}
    for tool in TOOLS:
        estimates = [r.estimates[tool] for r in rows if tool in r.estimates]
        errors = [abs(e.error) for e in estimates if e.error is not None]
        seconds = [e.seconds for e in estimates if e.predicted_bytes is not None and e.seconds]
        loads = [e.load_1m for e in estimates if e.predicted_bytes is not None]
        found[tool] = {
            "version": installed.get(tool),
            "compared": COMPARED[tool],
            "cases": len(rows),
            "predicted": len(errors),
            "exact": sum(e.error == 0 for e in estimates),
            "median_abs_error": statistics.median(errors) if errors else None,
            "worst_abs_error": max(errors, default=None),
            "within": sum(error <= WITHIN for error in errors),
            "under_predicted": sum(e.error is not None and e.error < 0 for e in estimates),
            "seconds_median": statistics.median(seconds) if seconds else None,
            "seconds_max": max(seconds, default=None),
            "load_1m_min": min(loads, default=None),
            "load_1m_max": max(loads, default=None),
        }
    return found


def _pct(value: float | None, sign: bool = True) -> str:
    if value is None:
        return "—"
    size = abs(value)
    places = 0 if size >= 1 else 1 if size >= 0.01 else 2 if size >= 1e-4 else 4
    return f"{100 * value:{'+' if sign else ''},.{places}f} %"


def _seconds(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.3f} s" if value >= 0.01 else f"{1000 * value:.2f} ms"


def _cell(row: Row, tool: str) -> str:
    estimate = row.estimates.get(tool)
    if estimate is None or estimate.predicted_bytes is None:
        return "—" if estimate is None else f"— ({estimate.note})"
    return (
        f"{estimate.predicted_bytes / MiB:,.2f} ({_pct(estimate.error)}) · "
        f"{_seconds(estimate.seconds)} · L {estimate.load_1m}"
    )


def _summary_line(tool: str, stats: dict[str, Any]) -> str:
    if not stats["predicted"]:
        why = "not installed" if stats["version"] is None else "no case predicted"
        return (
            f"| {tool} | {stats['version'] or '—'} | 0 / {stats['cases']} ({why}) |"
            + (" — |" * 5)
            + f" {REFERENCE[tool]} |"
        )
    median, worst = stats["median_abs_error"], stats["worst_abs_error"]
    return (
        f"| {tool} | {stats['version']} | {stats['predicted']} / {stats['cases']} "
        f"| {_pct(median, sign=False)} | {_pct(worst, sign=False)} "
        f"| {stats['within']} / {stats['predicted']} | {stats['under_predicted']} "
        f"| {_seconds(stats['seconds_median'])} (max {_seconds(stats['seconds_max'])}) "
        f"| {stats['load_1m_min']} to {stats['load_1m_max']} | {REFERENCE[tool]} |"
    )


def markdown(
    env: dict[str, Any], stats: dict[str, dict[str, Any]], rows: list[Row], failed: dict[str, str]
) -> str:
    """The report: the summary per tool, what each compares, then every case."""
    lines = [
        "# Will it fit? vramtune.fit and its peers against the real CPU peak",
        "",
        f"{env['date']} · torch {env['torch']} · Python {env['python']} · {env['cpus']} CPUs "
        f"(shared) · load average {env['load_start']} at the start, {env['load_end']} at the "
        f"end · `nice -n 19 python bench/fit_peers.py{env['arguments']}`",
        "",
        f"{len(rows)} cases: the zoo's {len(ZOO)} architectures and its {len(EXTRAS)} extras "
        "(bench/zoo) at their two CPU batch sizes, fp32, AdamW, one training step as asked. "
        "Measured: the real CPU run's tracked peak (live tensor bytes, two steps through "
        "`train_step`; `bench.predictor_accuracy.measure_cpu`). Error = (predicted - measured) "
        "/ measured; seconds are wall seconds of one prediction, L the 1-minute load average "
        "just before it.",
        "",
        f"| tool | version | cases predicted | median abs error | worst abs error "
        f"| within {100 * WITHIN:.0f} % | under-predicted | s / prediction (median) "
        "| load (1 min) | issue's earlier figure |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        *(_summary_line(tool, stats[tool]) for tool in TOOLS),
        "",
        "What each figure is:",
        "",
        *(f"- {tool}: {COMPARED[tool]}" for tool in TOOLS),
        "",
        "Per case: predicted MiB (error) · seconds · load.",
        "",
        "| case | measured MiB | " + " | ".join(TOOLS) + " |",
        "|---|---:|" + "---|" * len(TOOLS),
        *(
            f"| {r.case} | {r.measured_bytes / MiB:,.2f} | "
            + " | ".join(_cell(r, t) for t in TOOLS)
            + " |"
            for r in rows
        ),
    ]
    notes = [
        f"- {r.case}, {tool}: {e.note}"
        for r in rows
        for tool, e in r.estimates.items()
        if e.note and e.predicted_bytes is not None
    ]
    if notes:
        lines += ["", "Notes (how a tool got its number where it matters):", "", *notes]
    if failed:
        lines += ["", "Real runs that failed (left out):", ""]
        lines += [f"- {label}: {why}" for label, why in failed.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the cases, write fit_peers.{md,json}; non-zero if vramtune missed a case."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--quick", action="store_true", help="the smaller batch size only")
    parser.add_argument("--only", default="", help="comma-separated architectures to run")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    load_start = _load()
    rows, failed = run(fit_cases(args.quick, args.only))
    installed = versions()
    stats = summary(rows, installed)
    arguments = "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    env = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_start": load_start,
        "load_end": _load(),
        "arguments": arguments,
    }
    result = {
        "environment": env,
        "versions": installed,
        "summary": stats,
        "failed": failed,
        "reference_issue_45": REFERENCE,
        "rows": [asdict(r) for r in rows],
    }
    write_report(args.out, "fit_peers", result, markdown(env, stats, rows, failed))
    return 0 if stats["vramtune"]["exact"] == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
