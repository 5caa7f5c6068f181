"""The optimizers a plan swaps in for the task's own (the adamw_8bit and adafactor rungs).

Both change the numerics, so a plan takes them only when the study lists them. The trainer, the
trace and the probe all build them through `worker.trial.steps.build_optimizer_for_plan`, so a
prediction counts the state the run will hold.

adamw_8bit is torchao's `AdamW8bit` (pip install 'vramtune[optim8bit]'): AdamW's update with
both moments stored blockwise in 8 bits (a uint8 code per value and an fp32 scale per block of
256, ≈ 2 bytes a parameter instead of 8), each a tensor subclass (`OptimState8bit`) whose inner
tensors the memory tracker counts. torchao quantizes only tensors of at least 4,096 values whose
size divides into blocks; the rest keep fp32 moments, as AdamW's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from vramtune.service.wire import PlanOptimizer
from vramtune.worker.trial.runner import OPTIM8BIT_EXTRA, adamw_8bit_available
from vramtune.worker.trial.task import TaskConfigError

_ADAMW_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
"""What AdamW8bit takes of each of the task optimizer's parameter groups, where it has them."""


def swapped_optimizer(
    name: PlanOptimizer, task_optimizer: torch.optim.Optimizer
) -> torch.optim.Optimizer:
    """The optimizer `name` over the task optimizer's parameters, built before any step (the
    task's holds no state yet, so only its hyperparameters are read).

    adafactor: `torch.optim.Adafactor` at the first group's learning rate (factored second
    moments, no first moment). adamw_8bit: torchao's AdamW8bit over the task's parameter
    groups, each at its own learning rate, betas, eps and weight decay where the task's
    optimizer has them (an Adam-family one does), torchao's defaults otherwise.
    """
    groups = task_optimizer.param_groups
    if name == "adafactor":
        params = [p for group in groups for p in group["params"]]
        return torch.optim.Adafactor(params, lr=groups[0]["lr"])
    return _adamw_8bit(
        [
            {key: group[key] for key in ("params", *_ADAMW_HYPERPARAMETERS) if key in group}
            for group in groups
        ]
    )


def _adamw_8bit(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """torchao's AdamW8bit over `groups`, stepping eagerly under a dispatch mode.

    torchao compiles each parameter's update (`torch.compile(fullgraph=True)`), and dynamo
    refuses to compile under a non-infra dispatch mode: the memory tracker of a CPU run and of
    the trace is one. There the update runs eagerly (torch.compiler's force_eager stance), the
    same operators on real and fake tensors, so the trace's peak is the CPU run's. A CUDA run
    outside any mode compiles it: its fused update allocates no more than the eager one, whose
    temporaries (one parameter's at a time) the prediction then counts over.
    """
    if not adamw_8bit_available():
        raise TaskConfigError(
            f"the adamw_8bit rung needs torchao on this worker: {OPTIM8BIT_EXTRA}"
        )
    from torchao.optim import AdamW8bit  # type: ignore[import-untyped, unused-ignore]

    optimizer: torch.optim.Optimizer = AdamW8bit(groups)
    optimizer.step = _eager_under_dispatch_modes(optimizer.step)  # type: ignore[method-assign]
    return optimizer


def _eager_under_dispatch_modes(step: Callable[..., Any]) -> Callable[..., Any]:
    """`step`, run with every torch.compile ignored while a non-infra dispatch mode is on."""

    def step_here(*args: Any, **kwargs: Any) -> Any:
        if not is_in_torch_dispatch_mode(include_infra_modes=False):
            return step(*args, **kwargs)
        with torch.compiler.set_stance("force_eager"):
            return step(*args, **kwargs)

    return step_here
