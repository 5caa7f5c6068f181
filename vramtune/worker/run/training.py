"""The worker's training loop for torch tasks: `TorchTaskRunner`.

The runner owns the loop, as Lightning's Trainer owns a LightningModule's: it builds the task's
model under the plan (checkpointing), splits each step's batch into the plan's micro-batches
through `worker.trial.steps.train_step` (the function the predictor traces), evaluates every
`budget.eval_every` steps and reports through the agent, and measures the peak memory: torch's
allocator counters and NVML on CUDA, the tracked live tensor bytes on CPU, where the simulated
card's limit raises `OutOfMemory`.
"""

from __future__ import annotations

import gc
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from vramtune.common.memory import held_peak
from vramtune.service.wire import Measured, Plan, Prediction, TrainBudget
from vramtune.worker.device.memory import EVALUATION_PHASE, MemoryTracker
from vramtune.worker.trial.rungs import task_can_checkpoint
from vramtune.worker.trial.runner import (
    CardSpec,
    Config,
    OutOfMemory,
    Reporter,
    RunFailed,
    RunResult,
    Stopped,
    trial_config,
)
from vramtune.worker.trial.steps import (
    batch_feeder,
    build_for_plan,
    build_optimizer_for_plan,
    evaluate_step,
    micro_batch_sizes,
    train_step,
)
from vramtune.worker.trial.task import Batch, Task, TaskConfigError

logger = logging.getLogger(__name__)

# How often (in steps) the progress bar shows the loss: reading it syncs a CUDA device.
LOSS_DISPLAY_EVERY = 10
# Rank r of a distributed run draws its batches from seed + r * this: its own examples.
RANK_SEED_STRIDE = 1_000_003


class TrainingDiverged(RunFailed):
    """The metric became NaN or infinite: the trial fails, as Optuna fails a NaN objective."""


class PeakMeter(Protocol):
    """Measures one run's peak memory on its device.

    Contract:
        out_of_memory: the exception types that mean the run exceeded the card.
        __enter__/__exit__: the measured window (the model is built inside it).
        sample(): called after every step (NVML has no peak counter of its own).
        evaluation(): the window of one evaluation, whose peak is measured apart from the
            training steps' (a calibration compares the training step with its prediction).
        measured(): the peaks so far: the whole run's, the training steps' and the evaluations'.
    """

    out_of_memory: tuple[type[BaseException], ...]

    def __enter__(self) -> PeakMeter: ...

    def __exit__(self, *exc_info: object) -> None: ...

    def sample(self) -> None: ...

    def evaluation(self) -> AbstractContextManager[None]: ...

    def measured(self) -> Measured: ...


class CudaPeakMeter:
    """torch's allocator peaks (allocated, reserved) plus NVML's per-process figure."""

    out_of_memory: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.nvml_peak: int | None = None
        # torch keeps one peak counter: each evaluation resets it, so the windows' peaks are
        # folded here (the whole run's is the larger of the two).
        self.allocated = self.reserved = self.training_peak = 0
        self.evaluation_peak: int | None = None
        self.evaluating = False

    def __enter__(self) -> CudaPeakMeter:
        release_device_memory(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.sample()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.sample()

    def sample(self) -> None:
        """Fold NVML's current per-process usage into its peak."""
        used = _nvml_process_used(self.index)
        if used is not None:
            self.nvml_peak = max(used, self.nvml_peak or 0)

    @contextmanager
    def evaluation(self) -> Iterator[None]:
        """Measure the evaluation in its own window of torch's peak counters."""
        self.fold_window()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.evaluating = True
        try:
            yield
        finally:
            self.fold_window()
            self.evaluating = False
            # Reserved memory stays cached: the next training window starts from it.
            torch.cuda.reset_peak_memory_stats(self.device)

    def fold_window(self) -> None:
        """Fold the current window's max_memory_allocated / max_memory_reserved in."""
        allocated = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        self.allocated, self.reserved = max(self.allocated, allocated), max(self.reserved, reserved)
        held = held_peak(allocated, reserved)
        if self.evaluating:
            self.evaluation_peak = max(self.evaluation_peak or 0, held)
        else:
            self.training_peak = max(self.training_peak, held)

    def measured(self) -> Measured:
        """The allocator's peaks since the run began, NVML's, and the windows' apart."""
        self.fold_window()
        return Measured(
            peak_allocated_bytes=self.allocated,
            peak_reserved_bytes=self.reserved,
            nvml_peak_bytes=self.nvml_peak,
            training_peak_bytes=self.training_peak,
            evaluation_peak_bytes=self.evaluation_peak,
        )


class CpuPeakMeter:
    """Live tensor bytes, storage by storage; past `limit_bytes` the simulated card is full."""

    # MemoryLimitExceeded is a torch.OutOfMemoryError, as a real allocation failure is.
    out_of_memory: tuple[type[BaseException], ...] = (torch.OutOfMemoryError,)

    def __init__(self, limit_bytes: int | None) -> None:
        self.tracker = MemoryTracker(device_type="cpu", limit_bytes=limit_bytes)
        self.stack = ExitStack()
        self.evaluation_start: int | None = None

    def __enter__(self) -> CpuPeakMeter:
        self.stack.enter_context(self.tracker)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stack.close()

    def sample(self) -> None:
        """Nothing to sample: the tracker sees every allocation."""

    @contextmanager
    def evaluation(self) -> Iterator[None]:
        """Count what the evaluation allocates in its own phase of the tracker."""
        live = self.tracker.live_bytes
        self.evaluation_start = max(self.evaluation_start or 0, live)
        with self.tracker.phase(EVALUATION_PHASE):
            yield

    def measured(self) -> Measured:
        """The peak of live tensor bytes (no allocator, hence no reserved figure), and the
        training steps' and the evaluations' apart (the tracker's phase peaks)."""
        phases = self.tracker.phase_peaks
        training = max((v for k, v in phases.items() if k != EVALUATION_PHASE), default=0)
        evaluation = phases.get(EVALUATION_PHASE, self.evaluation_start)
        return Measured(
            peak_allocated_bytes=self.tracker.peak_bytes,
            training_peak_bytes=training,
            evaluation_peak_bytes=evaluation,
        )


def _nvml_process_used(device_index: int) -> int | None:
    """NVML's figure for this process, when vramtune.worker.device.gpu (the one pynvml module) gives
    it."""
    try:
        from vramtune.worker.device import gpu
    except ImportError:
        return None
    return gpu.process_used_bytes(device_index)


def release_device_memory(device: torch.device) -> None:
    """Free what dead tensors still hold so the next run starts from a clean card."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def meter_for(card: CardSpec) -> PeakMeter:
    """The meter for the card's device: CUDA counters, or tracked live bytes on CPU."""
    device = torch.device(card.device)
    if device.type == "cuda":
        return CudaPeakMeter(device)
    return CpuPeakMeter(card.info.total_bytes if card.info.simulated else None)


@dataclass
class _Progress:
    """A progress bar on an interactive terminal, plain log lines otherwise."""

    label: str
    total_steps: int | None
    bar: Any = None

    def __post_init__(self) -> None:
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=self.total_steps, desc=self.label, unit="step", leave=False)

    def stepped(self, step: int, loss: torch.Tensor) -> None:
        """Advance the bar; show the loss now and then."""
        if self.bar is not None:
            self.bar.update(1)
            if step % LOSS_DISPLAY_EVERY == 0:
                self.bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)

    def evaluated(self, step: int, loss: torch.Tensor, metric: str, value: float) -> None:
        """Show an evaluation on the bar, or log it."""
        if self.bar is not None:
            self.bar.set_postfix({"loss": f"{float(loss):.4f}", metric: f"{value:.4f}"})
        else:
            logger.info(
                "%s step %d/%s loss %.4f %s %.4f",
                self.label,
                step,
                self.total_steps or "-",
                float(loss),
                metric,
                value,
            )

    def close(self) -> None:
        """Remove the bar."""
        if self.bar is not None:
            self.bar.close()


@dataclass
class _Loop:
    """One run's state: the model, its optimizer and the clocks."""

    task: Task
    config: Config
    plan: Plan
    budget: TrainBudget
    device: torch.device
    meter: PeakMeter
    reporter: Reporter
    # A distributed rank wraps the model (DDP, FSDP2) before its optimizer is built.
    wrap: Callable[[nn.Module], nn.Module] | None = None
    started: float = field(default_factory=time.monotonic)
    eval_seconds: float = 0.0
    steps: int = 0

    def run(self, batches: Iterator[Batch]) -> RunResult:
        """Train within the budget, evaluating and reporting on schedule; the final metric."""
        batch_size = int(self.config[self.task.batch_size_param])
        model = build_for_plan(self.task, self.config, self.plan, self.device)
        if self.wrap is not None:
            model = self.wrap(model)
        optimizer = build_optimizer_for_plan(self.task, model, self.config, self.plan)
        next_batch = batch_feeder(batches)
        progress = _Progress(self.task.name, self.budget.max_steps)
        value: float | None = None
        try:
            while not self.budget_spent():
                self.check_stop()
                loss = train_step(
                    self.task, model, optimizer, next_batch, batch_size, self.plan, self.device
                )
                self.steps += 1
                self.meter.sample()
                progress.stepped(self.steps, loss)
                value = None
                if self.steps % self.budget.eval_every == 0:
                    value = self.evaluate(model, optimizer)
                    progress.evaluated(self.steps, loss, self.task.metric.name, value)
                    if self.reporter.report(self.steps, value):
                        raise Stopped("pruned", self.meter.measured())
            if value is None:
                value = self.evaluate(model, optimizer)
        finally:
            progress.close()
        return self.result(value, batch_size)

    def budget_spent(self) -> bool:
        """Whether the step or time budget is used up (never before the first step)."""
        max_steps, max_seconds = self.budget.max_steps, self.budget.max_seconds
        if self.steps == 0:
            return False
        if max_steps is not None and self.steps >= max_steps:
            return True
        return max_seconds is not None and time.monotonic() - self.started >= max_seconds

    def check_stop(self) -> None:
        """Raise Stopped when the agent wants this run to end (between steps)."""
        reason = self.reporter.stop_reason()
        if reason is not None:
            raise Stopped(reason, self.meter.measured())

    def evaluate(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
        """The task's metric (`evaluate_step`), its peak measured apart from training's."""
        began = time.monotonic()
        try:
            with self.meter.evaluation():
                value = evaluate_step(
                    self.task, model, optimizer, self.config, self.plan, self.device
                )
        finally:
            self.eval_seconds += time.monotonic() - began
        if not math.isfinite(value):
            raise TrainingDiverged(
                f"{self.task.metric.name} is {value} after {self.steps} steps (training diverged)",
                self.meter.measured(),
            )
        return value

    def result(self, value: float, batch_size: int) -> RunResult:
        """The run's metric, peaks, duration and throughput."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        duration = time.monotonic() - self.started
        train_seconds = max(duration - self.eval_seconds, 1e-9)
        return RunResult(
            values=[value],
            measured=self.meter.measured(),
            duration_s=duration,
            samples_per_s=self.steps * batch_size / train_seconds,
            steps=self.steps,
        )


class TorchTaskRunner:
    """Runs a `vramtune.worker.trial.task.Task`'s trials with the worker-owned loop (a
    `TrialRunner`)."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.task_name = task.name
        # A task may say it has nothing to checkpoint or must stay in fp32; a PlainTask that
        # marks no modules has nothing to checkpoint either (worker/trial/rungs.py).
        self.can_checkpoint = task_can_checkpoint(task)
        self.can_bf16 = bool(getattr(task, "can_bf16", True))
        # This loop builds the optimizer (build_optimizer_for_plan): the adafactor rung.
        self.can_swap_optimizer = True
        # ... and runs the step (train_step): the offload rungs, on a CUDA card.
        self.can_offload = True

    def batch_size(self, config: Config) -> int:
        """The configuration's effective batch size; a configuration without it is refused
        before anything runs, naming the parameter (a study created before any worker said
        which key the task reads is not checked at creation: service/fleet/offers.py)."""
        param = self.task.batch_size_param
        if param not in config:
            raise TaskConfigError(
                f"task {self.task.name!r} reads its batch size from {param!r}, which neither the "
                f"study's search_space nor its task_config gives: add {param!r} to one of them"
            )
        return int(config[param])

    def checkpoint_block_count(self, config: Config) -> int | None:
        """The task's checkpointable blocks when it can checkpoint some of them, else None."""
        count = getattr(self.task, "checkpoint_block_count", None)
        return int(count(config)) if self.can_checkpoint and count is not None else None

    def can_chunk_loss(self, config: Config) -> bool:
        """Whether the task computes its loss in chunks when asked (`enable_chunked_loss`)."""
        return getattr(self.task, "enable_chunked_loss", None) is not None

    def predict(self, config: Config, plan: Plan, card: CardSpec) -> Prediction:
        """The predictor's traced peak for `config` under `plan` on `card`."""
        from vramtune.worker.predictor import predict

        prediction: Prediction = predict(self.task, config, plan, card)
        return prediction

    def largest_micro_batch(
        self, config: Config, plan: Plan, budget_bytes: int, card: CardSpec
    ) -> tuple[int, Prediction] | None:
        """The predictor's largest micro-batch of an even split (the policy's plans) fitting
        `budget_bytes` under `plan`'s flags."""
        from vramtune.worker.predictor import largest_micro_batch

        found: tuple[int, Prediction] | None = largest_micro_batch(
            self.task, config, plan, budget_bytes, card, even=True
        )
        return found

    def run(
        self, config: Config, plan: Plan, budget: TrainBudget, card: CardSpec, reporter: Reporter
    ) -> RunResult:
        """Train `config` under `plan` within `budget`; raises OutOfMemory past the card."""
        return self.run_wrapped(config, plan, budget, card, reporter)

    def run_wrapped(
        self,
        config: Config,
        plan: Plan,
        budget: TrainBudget,
        card: CardSpec,
        reporter: Reporter,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
        rank: int = 0,
    ) -> RunResult:
        """`run`, the model wrapped by `wrap` (a distributed rank, vramtune.worker.run.ranks), the
        data drawn for `rank` (every rank builds the same model, each trains on its own batches)."""
        device = torch.device(card.device)
        micro = micro_batch_sizes(self.batch_size(config), plan)[0]
        seed = int(config.get("seed", 0))
        # The task loads its data here, outside the measured window: data stays on the host.
        batches = self.task.batches(config, micro, device, seed + RANK_SEED_STRIDE * rank)
        meter = meter_for(card)
        try:
            with meter:
                torch.manual_seed(seed)
                loop = _Loop(self.task, config, plan, budget, device, meter, reporter, wrap)
                return loop.run(batches)
        except meter.out_of_memory as error:
            message = f"out of memory: {error}"
        # Out of the except block the traceback, and the tensors its frames hold, are gone.
        release_device_memory(device)
        measured = meter.measured()
        logger.warning(
            "%s: %s (peak %d bytes)", self.task_name, message, measured.peak_allocated_bytes
        )
        raise OutOfMemory(message, measured)


__all__ = [
    "CpuPeakMeter",
    "CudaPeakMeter",
    "PeakMeter",
    "TorchTaskRunner",
    "TrainingDiverged",
    "meter_for",
    "release_device_memory",
    "trial_config",
]
