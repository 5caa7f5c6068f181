"""A synthetic task without torch: a quadratic metric and an analytic memory footprint.

It drives the protocol, the plan choice and the end-to-end tests in milliseconds. The
"memory" of a configuration is affine in the micro-batch, as the predictor finds it for real
models (worker/predictor), so resizing, routing and the OOM path behave as they do on a card:

    peak = fixed_bytes + width * (weight_bytes + micro_batch * activation_bytes * shrink)

where `shrink` is 1/2 with activation checkpointing and 1/2 again with bf16. Running a plan whose
peak exceeds the card raises `OutOfMemory` at `oom_step`, as a real CUDA OOM does once the
optimizer state exists. A run sleeps `startup_seconds` (a real task builds its model and loads
its data), then `step_seconds` per step times the plan's expected slowdown (worker/plan/policy.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vramtune.common.units import human_bytes
from vramtune.service.wire import Measured, Plan, Prediction, TrainBudget
from vramtune.worker.plan.policy import expected_slowdown
from vramtune.worker.trial.runner import CardSpec, Config, OutOfMemory, Reporter, RunResult, Stopped

MIB = 1024 * 1024


@dataclass(frozen=True)
class QuadraticConfig:
    """The configuration's knobs, with their defaults (task_config and params both feed it)."""

    x: float = 0.0
    y: float = 0.0
    batch_size: int = 32
    width: int = 64
    fixed_bytes: int = 16 * MIB
    weight_bytes: int = 64 * 1024
    activation_bytes: int = 4 * 1024
    step_seconds: float = 0.002
    startup_seconds: float = 0.0
    oom_step: int = 2
    oom_above_micro_batch: int = 0
    objectives: int = 1
    # Bytes the run holds that predict() does not see, as an evaluation over the whole held-out
    # set in one pass would: the biased calibration the dashboard's advice explains.
    unpredicted_bytes: int = 0

    @classmethod
    def of(cls, config: Config) -> QuadraticConfig:
        """Read the known keys of a trial's configuration, ignoring the others."""
        kinds: dict[str, Callable[[Any], Any]] = {
            name: type(value) for name, value in vars(cls()).items()
        }
        try:
            # Each key takes the type of its default: a string where a number belongs fails here.
            parsed = cls(**{k: kind(config[k]) for k, kind in kinds.items() if k in config})
            for name in ("batch_size", "width", "objectives"):
                if int(getattr(parsed, name)) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(parsed, name)}")
        except (TypeError, ValueError) as error:
            raise QuadraticConfigError(f"quadratic: {error}") from error
        return parsed


class QuadraticConfigError(ValueError):
    """A configuration the quadratic task cannot run (reported as a failed trial)."""


class QuadraticTask:
    """The quadratic task as a `TrialRunner` (see vramtune/worker/trial/runner.py)."""

    task_name = "quadratic"
    can_checkpoint = True
    can_bf16 = True

    def batch_size(self, config: Config) -> int:
        """The effective batch size: the `batch_size` key."""
        return int(QuadraticConfig.of(config).batch_size)

    def predict(self, config: Config, plan: Plan, card: CardSpec) -> Prediction:
        """The analytic peak of `config` under `plan` (exact: the run allocates the same)."""
        peak = footprint_bytes(QuadraticConfig.of(config), plan)
        return Prediction(
            peak_allocated_bytes=peak,
            peak_reserved_bytes=peak,
            breakdown=_breakdown(QuadraticConfig.of(config), plan),
            method="trace",
        )

    def run(
        self, config: Config, plan: Plan, budget: TrainBudget, card: CardSpec, reporter: Reporter
    ) -> RunResult:
        """Sleep through the steps, report the converging metric, fail past the card."""
        cfg = QuadraticConfig.of(config)
        peak = footprint_bytes(cfg, plan) + cfg.unpredicted_bytes
        measured = Measured(peak_allocated_bytes=peak, peak_reserved_bytes=peak)
        limit = card.info.free_bytes
        micro = _micro_batch(cfg, plan)
        step_seconds = cfg.step_seconds * expected_slowdown(plan, int(cfg.batch_size))
        started = time.monotonic()
        time.sleep(cfg.startup_seconds)  # building the model and loading data, on a real task
        step = 0
        for step in range(1, _max_steps(budget) + 1):
            reason = reporter.stop_reason()
            if reason is not None:
                raise Stopped(reason, measured)
            time.sleep(step_seconds)
            if step >= cfg.oom_step and (peak > limit or 0 < cfg.oom_above_micro_batch < micro):
                raise OutOfMemory(
                    f"simulated OOM at step {step}: {human_bytes(peak)} needed, "
                    f"micro-batch {micro}, card holds {human_bytes(limit)}",
                    measured,
                )
            if step % budget.eval_every == 0 and reporter.report(step, _value_at(cfg, step)):
                raise Stopped("pruned", measured)
            if budget.max_seconds is not None and time.monotonic() - started >= budget.max_seconds:
                break
        duration = time.monotonic() - started
        return RunResult(
            values=objective_values(cfg),
            measured=measured,
            duration_s=duration,
            samples_per_s=step * cfg.batch_size / duration if duration > 0 else None,
            steps=step,
        )


def footprint_bytes(cfg: QuadraticConfig, plan: Plan) -> int:
    """Peak bytes of one step: fixed + weights + the micro-batch's activations."""
    return sum(_breakdown(cfg, plan).values())


def _breakdown(cfg: QuadraticConfig, plan: Plan) -> dict[str, int]:
    shrink = (0.5 if plan.checkpointing else 1.0) * (0.5 if plan.bf16 else 1.0)
    activations = math.ceil(cfg.width * _micro_batch(cfg, plan) * cfg.activation_bytes * shrink)
    return {
        "fixed": int(cfg.fixed_bytes),
        "weights": int(cfg.width) * int(cfg.weight_bytes),
        "activations": activations,
    }


def _micro_batch(cfg: QuadraticConfig, plan: Plan) -> int:
    return min(plan.micro_batch or int(cfg.batch_size), int(cfg.batch_size))


def _max_steps(budget: TrainBudget) -> int:
    # A seconds-only budget still needs a bound on the loop; the seconds check ends it.
    return budget.max_steps if budget.max_steps is not None else 10**9


def quadratic_value(cfg: QuadraticConfig) -> float:
    """The metric (minimized): best near x=1, y=-0.5, a large batch and a wide model."""
    batch_term = 0.05 * math.log2(cfg.batch_size / 256) ** 2
    width_term = 0.05 * math.log2(cfg.width / 512) ** 2
    return float((cfg.x - 1.0) ** 2 + (cfg.y + 0.5) ** 2 + batch_term + width_term)


def objective_values(cfg: QuadraticConfig) -> list[float]:
    """The task's metric(s): the quadratic, then (for two objectives) the distance to the origin."""
    values = [quadratic_value(cfg), float(math.hypot(cfg.x, cfg.y))]
    return values[: int(cfg.objectives)]


def _value_at(cfg: QuadraticConfig, step: int) -> float:
    # Converges to the final value from above, like a training loss.
    return quadratic_value(cfg) + 1.0 / step
