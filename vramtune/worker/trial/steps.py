"""One optimizer step under a plan: the code path both the trainer and the predictor run.

The trainer calls `train_step` on real tensors; the predictor calls the very same function
under a FakeTensorMode, so what it measures is what the trainer will allocate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from vramtune.service.wire import Plan
from vramtune.worker.device.memory import attributed_to
from vramtune.worker.trial.offload import host_for, offload_activations, offload_optimizer, offloads
from vramtune.worker.trial.optimizers import swapped_optimizer
from vramtune.worker.trial.runner import (
    plan_for_micro_batch as plan_for_micro_batch,  # torch-free home
)
from vramtune.worker.trial.task import Batch, Config, Task, TaskConfigError


def micro_batch_sizes(batch_size: int, plan: Plan) -> list[int]:
    """Split the effective batch into the plan's micro-batches (the last may be smaller)."""
    if batch_size < 1:
        raise TaskConfigError(f"batch size must be >= 1, got {batch_size}")
    micro = min(plan.micro_batch or batch_size, batch_size)
    full, rest = divmod(batch_size, micro)
    return [micro] * full + ([rest] if rest else [])


def traced_micro_batch_sizes(batch_size: int, plan: Plan) -> list[int]:
    """The micro-batches whose allocations are those of the whole step: the first two, the tail.

    The first micro-batch's backward creates the gradients; every later one starts from the
    same live set (gradients held, one loss accumulator) and allocates what the second does, so
    tracing the second stands for all of them but a smaller tail. A trace then costs the same
    for a micro-batch of 1 as for the batch as asked.
    """
    sizes = micro_batch_sizes(batch_size, plan)
    if len(sizes) <= 2:
        return sizes
    tail = [sizes[-1]] if sizes[-1] != sizes[0] else []
    return sizes[:2] + tail


def autocast_for(plan: Plan, device: torch.device) -> AbstractContextManager[object]:
    """bf16 autocast when the plan asks for it, else nothing."""
    if not plan.bf16:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def apply_checkpointing(task: Task, model: nn.Module, blocks: int | None = None) -> int:
    """Recompute the task's checkpointable blocks in backward (the first `blocks` of them, all
    when None: selective checkpointing); returns how many were wrapped.

    A task with its own `enable_checkpointing(model)` (transformers' and timm's built-in
    checkpointing) uses that instead, passed `blocks` when selective; it returns whether it
    could.
    """
    enable = getattr(task, "enable_checkpointing", None)
    if enable is not None:
        return int(bool(enable(model) if blocks is None else enable(model, blocks)))
    modules = list(task.checkpoint_modules(model))[:blocks]
    for module in modules:
        checkpoint_forward(module)
    return len(modules)


def enable_chunked_loss(task: Task, model: nn.Module) -> None:
    """Let the task compute its loss in chunks on this model (the chunked_cross_entropy rung)."""
    enable = getattr(task, "enable_chunked_loss", None)
    if enable is None or not enable(model):
        raise TaskConfigError(f"task {task.name!r} cannot compute its loss in chunks")


def checkpoint_forward(module: nn.Module) -> None:
    """Make `module` recompute its forward in the backward pass instead of keeping activations."""
    # non-reentrant checkpointing works with kwargs and under FakeTensorMode.
    module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)


def build_for_plan(task: Task, config: Config, plan: Plan, device: torch.device) -> nn.Module:
    """Build the task's model on `device` with the plan's checkpointing applied (a plan that
    offloads to the host is refused on a device without one: `host_for`)."""
    if offloads(plan):
        host_for(device)
    model = task.build_model(config)
    if not _lives_on(model, device):
        # Module.to swaps fake parameters, which FakeTensorMode's weakrefs forbid: the predictor
        # builds on the trace device already, so only real models move.
        model = model.to(device)
    if plan.checkpointing and apply_checkpointing(task, model, plan.checkpoint_blocks) == 0:
        raise TaskConfigError(f"task {task.name!r} marks no modules for checkpointing")
    if plan.chunked_loss:
        enable_chunked_loss(task, model)
    return model


def build_optimizer_for_plan(
    task: Task, model: nn.Module, config: Config, plan: Plan
) -> torch.optim.Optimizer:
    """The task's optimizer over `model`, or, when the plan swaps it (the adamw_8bit and
    adafactor rungs, which change the numerics), the one it names built from the task's
    (`worker.trial.optimizers`: 8-bit AdamW's state is a quarter of AdamW's, Adafactor keeps
    factored second moments and no first moment). The trainer and the predictor both build it
    here, so the prediction counts its state. The optimizer_offload rung then runs it on host
    copies of the parameters (worker/trial/offload.py): its state never reaches the card."""
    optimizer = task.build_optimizer(model, config)
    if plan.optimizer is not None:
        optimizer = swapped_optimizer(plan.optimizer, optimizer)
    return offload_optimizer(optimizer, model) if plan.optimizer_offload else optimizer


def _lives_on(model: nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer of `model` is on `device` already."""
    return all(
        t.device.type == device.type and device.index in (None, t.device.index)
        for t in (*model.parameters(), *model.buffers())
    )


def train_step(
    task: Task,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    next_batch: Callable[[int], Batch],
    batch_size: int,
    plan: Plan,
    device: torch.device,
    sizes: Sequence[int] | None = None,
    *,
    accumulating: bool = False,
) -> torch.Tensor:
    """One optimizer step over `batch_size` examples as the plan's micro-batches.

    Each micro-batch's mean loss is weighted by its share of the effective batch, so the
    accumulated gradient equals the full batch's. Returns the step's loss (detached). `sizes`
    overrides the micro-batches run (the predictor's `traced_micro_batch_sizes`);
    `accumulating` keeps the gradients there are (the predictor stands them in for a first
    micro-batch it does not trace).
    """
    if not accumulating:
        optimizer.zero_grad(set_to_none=True)
    # Accumulating, the zeros stand for the accumulator the untraced first micro-batch left
    # after its backward, and are counted in that phase (as the category it falls in).
    with attributed_to("backward") if accumulating else nullcontext():
        total = torch.zeros((), device=device)
    for size in sizes if sizes is not None else micro_batch_sizes(batch_size, plan):
        batch = next_batch(size)
        with autocast_for(plan, device), offload_activations(plan, device):
            loss = task.loss(model, batch) * (size / batch_size)
        torch.autograd.backward(loss)
        # Made after backward, with every gradient held: the forward phase's peak (the lines
        # largest_micro_batch fits) is the forward's own allocations, not this level.
        with attributed_to("backward"):
            total = total + loss.detach().float()
        del batch, loss
    optimizer.step()
    return total


def batch_feeder(batches: Iterator[Batch]) -> Callable[[int], Batch]:
    """Turn a task's iterator of fixed-size batches into `next_batch(size)`, slicing the tail."""

    def next_batch(size: int) -> Batch:
        batch = next(batches)
        return tuple(t[:size] for t in batch)

    return next_batch


def evaluate_step(
    task: Task,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config,
    plan: Plan,
    device: torch.device,
) -> float:
    """The task's metric as the trainer takes it, the code path the predictor traces too.

    The gradients are dropped first (the next step drops them anyway), and the task gets the
    plan's micro-batch as its batch size, so a task that evaluates in chunks of it stays near
    the training step's footprint. A task that evaluates everything at once is not held to it:
    the predictor traces this function and the plan fits whichever peak is larger.
    """
    optimizer.zero_grad(set_to_none=True)
    micro = micro_batch_sizes(int(config[task.batch_size_param]), plan)[0]
    eval_config = {**config, task.batch_size_param: micro}
    model.eval()
    try:
        with torch.no_grad(), autocast_for(plan, device):
            return float(task.evaluate(model, eval_config, device))
    finally:
        model.train()
