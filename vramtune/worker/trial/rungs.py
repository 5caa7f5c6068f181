"""Which rungs of the plan ladder a runner can take: the one answer the fit policy
(worker/plan/policy.py), `vramtune tasks check` and the worker's registration (which the
dashboard's advice reads) all use, so a rung a task cannot take is never chosen, never advised
and never claimed (issue 43).

Torch-free: the policy imports it.
"""

from __future__ import annotations

from typing import Any, cast

from vramtune.common.plans import RUNG_WORDS
from vramtune.service.wire import Resize
from vramtune.worker.trial.runner import Config, PlanRungs, TrialRunner, adamw_8bit_available

RUNG_ORDER: tuple[Resize, ...] = tuple(cast(Resize, rung) for rung in RUNG_WORDS)
"""The rungs in the ladder's order (the order vramtune.common.plans.RUNG_WORDS lists them)."""

CUDA_ONLY: frozenset[Resize] = frozenset({"activation_offload", "optimizer_offload"})
"""Rungs that free nothing on the CPU, where host and card are one memory."""


def task_can_checkpoint(task: Any) -> bool:
    """Whether a Task can recompute activations at all: it does not say it cannot
    (``can_checkpoint = False``), and it has the model's own checkpointing
    (``enable_checkpointing``) or a ``checkpoint_modules`` of its own. PlainTask's default
    ``checkpoint_modules`` marks none (``marks_no_modules``): a PlainTask that does not
    override it has nothing to checkpoint, and a plan asking for checkpointing would fail its
    trial ("marks no modules for checkpointing")."""
    if not bool(getattr(task, "can_checkpoint", True)):
        return False
    if getattr(task, "enable_checkpointing", None) is not None:
        return True
    modules = getattr(task, "checkpoint_modules", None)
    return modules is not None and not getattr(modules, "marks_no_modules", False)


def supported_rungs(
    runner: TrialRunner, device: str | None = None, config: Config | None = None
) -> list[Resize]:
    """The rungs `runner` can take, in the ladder's order.

    `device`: the card's ("cpu", "cuda:0"); the offload rungs need a CUDA card (None: any
    card, so they count where the runner can take them). `config`: one configuration, whose
    blocks and loss decide selective checkpointing and chunked cross-entropy (None: whether
    the task can for some configuration)."""
    task = getattr(runner, "task", runner)
    can_swap = bool(getattr(runner, "can_swap_optimizer", False))
    checkpointing = bool(runner.can_checkpoint)
    can: dict[Resize, bool] = {
        "micro_batch": True,
        "checkpointing": checkpointing,
        "selective_checkpointing": checkpointing and _selective(runner, task, config),
        "chunked_cross_entropy": isinstance(runner, PlanRungs)
        and runner.can_chunk_loss(config or {}),
        "activation_offload": bool(getattr(runner, "can_offload", False)),
        "optimizer_offload": bool(getattr(runner, "can_offload", False)),
        "bf16": bool(runner.can_bf16),
        "adamw_8bit": can_swap and adamw_8bit_available(),
        "adafactor": can_swap,
    }
    on_cpu = device is not None and not device.startswith("cuda")
    return [r for r in RUNG_ORDER if can[r] and not (on_cpu and r in CUDA_ONLY)]


def _selective(runner: TrialRunner, task: Any, config: Config | None) -> bool:
    """Selective checkpointing needs blocks to choose from: more than one for `config`; for
    any configuration, a task that counts them (``checkpoint_block_count``)."""
    if not isinstance(runner, PlanRungs):
        return False
    if config is None:
        return getattr(task, "checkpoint_block_count", None) is not None
    blocks = runner.checkpoint_block_count(config)
    return blocks is not None and blocks > 1


def rungs_in_words(rungs: list[Resize]) -> str:
    """`tasks check`'s line: the rungs a task supports, the CUDA-only ones marked."""
    return ", ".join(f"{r} (CUDA cards)" if r in CUDA_ONLY else r for r in rungs)
