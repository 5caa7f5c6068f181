"""The seam between the worker agent and whatever runs a trial.

The agent (worker/loop/agent.py) speaks the REST protocol and chooses plans (worker/plan/policy.py);
a `TrialRunner` predicts and runs one task's configurations. Torch tasks are wrapped by
`worker.run.training.TorchTaskRunner`; the synthetic quadratic task is a runner of its own, so the
protocol can be exercised without torch.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from vramtune.service.wire import CardInfo, Measured, Plan, Prediction, StopReason, TrainBudget

Config = Mapping[str, Any]


OPTIM8BIT_EXTRA = "pip install 'vramtune[optim8bit]'"
"""What installs the adamw_8bit rung's package (torchao) on a worker."""


def adamw_8bit_available() -> bool:
    """Whether torchao, the adamw_8bit rung's package, is installed on this worker (asked here
    without importing torch: the fit policy is torch-free)."""
    return importlib.util.find_spec("torchao") is not None


def plan_for_micro_batch(batch_size: int, micro_batch: int, **flags: Any) -> Plan:
    """A plan that runs `batch_size` as micro-batches of at most `micro_batch`."""
    micro = max(1, min(micro_batch, batch_size))
    return Plan(
        micro_batch=None if micro == batch_size else micro,
        accumulation=math.ceil(batch_size / micro),
        **flags,
    )


def micro_batch_choices(batch: int, even: bool = True) -> list[int]:
    """The micro-batches a plan search considers, ascending: those that split `batch` into
    equal parts, ceil(batch / k) for k micro-batches (or, not `even`, all of [1, batch]).

    The largest even one that fits is the policy's plan: the largest micro-batch m that fits,
    evened to ceil(batch / ceil(batch / m)) (the same number of micro-batches, a lower peak).
    """
    if not even:
        return list(range(1, batch + 1))
    return sorted({math.ceil(batch / k) for k in range(1, batch + 1)})


@dataclass
class RunResult:
    """What a finished run measured. `values` holds the task's metric(s) only; the agent
    appends the peak memory when the study minimizes it."""

    values: list[float]
    measured: Measured
    duration_s: float
    samples_per_s: float | None = None
    steps: int = 0


def trial_config(task_config: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """A trial's configuration: the study's fixed task_config overlaid with the sampled params."""
    return {**task_config, **params}


class OutOfMemory(Exception):
    """The run exceeded the card (a real CUDA OOM or the simulated card's limit)."""

    def __init__(self, message: str, measured: Measured) -> None:
        super().__init__(message)
        self.measured = measured


class RunFailed(Exception):
    """The run trained and then failed (say its metric diverged): the trial fails, and the peak
    it measured still goes to the server as an observation."""

    def __init__(self, message: str, measured: Measured | None = None) -> None:
        super().__init__(message)
        self.measured = measured


class Stopped(Exception):
    """The run was stopped from outside: pruned, study paused/deleted, lease lost, SIGTERM."""

    def __init__(self, reason: StopReason | str, measured: Measured | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.measured = measured


class Reporter(Protocol):
    """How a running trial talks back to the agent.

    Contract:
        report(step, value): send an intermediate value; returns True when the study's pruner
            prunes the trial (the runner must then raise `Stopped("pruned")`).
        stop_reason(): a reason when the agent wants the run to stop now (checked between steps),
            else None.
    """

    def report(self, step: int, value: float) -> bool: ...

    def stop_reason(self) -> str | None: ...


@dataclass
class CardSpec:
    """The card a prediction is for: the wire facts plus constants measured at start."""

    info: CardInfo
    constants: dict[str, int] = field(default_factory=dict)
    device: str = "cpu"


@runtime_checkable
class PlanRungs(Protocol):
    """A runner that offers the rungs past all-or-nothing checkpointing (worker/plan/policy.py).

    Contract:
        checkpoint_block_count(config): how many blocks selective checkpointing chooses among
            (a plan's `checkpoint_blocks` = k checkpoints the first k); None when it cannot.
        can_chunk_loss(config): whether the loss can be computed in chunks without changing it
            (the chunked_cross_entropy rung).
    """

    def checkpoint_block_count(self, config: Config) -> int | None: ...

    def can_chunk_loss(self, config: Config) -> bool: ...


@runtime_checkable
class TrialRunner(Protocol):
    """Predicts and runs one task's configurations.

    Contract:
        task_name: the task name advertised to the server.
        batch_size(config): the configuration's effective batch size (never changed by a plan).
        can_checkpoint: whether a plan may ask for activation checkpointing.
        can_bf16: whether a plan may ask for bf16 autocast.
        can_swap_optimizer (optional, False when absent): whether a plan may swap the task's
            optimizer for 8-bit AdamW or Adafactor (the adamw_8bit and adafactor rungs; only a
            runner whose loop builds the optimizer, `vramtune.worker.trial.steps.
            build_optimizer_for_plan`, can; adamw_8bit also needs `adamw_8bit_available`).
        can_offload (optional, False when absent): whether a plan may keep the saved
            activations or the optimizer on the host (the offload rungs, offered on CUDA cards
            only; a runner whose loop runs `vramtune.worker.trial.steps.train_step` and builds the
            optimizer there can).
        predict(config, plan, card): the predicted peak of running `config` under `plan` on
            `card`; never allocates device memory. A configuration that cannot be traced gives
            method "probe" (measured on the card) or "none" with a reason.
        run(config, plan, budget, card, reporter): train within the budget, report intermediate
            values through `reporter`, return the final metric(s) and measured peaks. Raises
            `OutOfMemory` past the card's memory, `Stopped` when pruned or told to stop, and
            `vramtune.worker.trial.task.TaskConfigError` for a configuration that cannot be built.
    """

    task_name: str
    can_checkpoint: bool
    can_bf16: bool

    def batch_size(self, config: Config) -> int: ...

    def predict(self, config: Config, plan: Plan, card: CardSpec) -> Prediction: ...

    def run(
        self, config: Config, plan: Plan, budget: TrainBudget, card: CardSpec, reporter: Reporter
    ) -> RunResult: ...
