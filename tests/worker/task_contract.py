"""A contract test any task can run against itself: ``check_task(task, config)``.

It checks what the worker and the predictor rely on: the declared attributes, that the model
builds (also under a FakeTensorMode, as the predictor builds it), that ``example_batch`` has the
shapes and dtypes of real batches, that the loss is a finite scalar with gradients, that
``evaluate`` returns a finite, repeatable float, that checkpointable modules are sub-modules
and checkpointing computes the same loss, that a traced training step needs no tensor values,
that micro-batching with accumulation gives the full batch's gradients, and that the
configurations the task calls impossible raise ``TaskConfigError``.

Use it from a test::

    from task_contract import check_task

    def test_my_task_keeps_the_contract() -> None:
        check_task(MyTask(), {"width": 16, "batch_size": 8}, bad_configs=[{"width": 0}])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from pydantic import TypeAdapter
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from service.wire import CardInfo, Name, Plan, TrainBudget
from worker.runner import CardSpec, RunResult
from worker.steps import build_for_plan, train_step
from worker.task import Batch, Task, TaskConfigError
from worker.training import TorchTaskRunner

MICRO_SIZES = (1, 3)
GIB = 1024**3


class RecordingReporter:
    """A Reporter that keeps what was reported and prunes or stops when told to."""

    def __init__(self, prune_at: int | None = None, stop_after: int | None = None) -> None:
        self.reports: list[tuple[int, float]] = []
        self.prune_at = prune_at
        self.stop_after = stop_after
        self.polls = 0

    def report(self, step: int, value: float) -> bool:
        """Keep the value; prune from step `prune_at` on."""
        self.reports.append((step, value))
        return self.prune_at is not None and step >= self.prune_at

    def stop_reason(self) -> str | None:
        """'paused' once polled more than `stop_after` times."""
        self.polls += 1
        return "paused" if self.stop_after is not None and self.polls > self.stop_after else None


@contextmanager
def cpu_threads(count: int) -> Iterator[None]:
    """Run torch's CPU ops on `count` threads: tiny models gain nothing from more, and on a
    busy two-core machine their threads only wait for each other (10x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def simulated_card(limit_bytes: int = GIB) -> CardSpec:
    """A CPU card of `limit_bytes`, as ``--device cpu --memory-limit`` gives."""
    info = CardInfo(
        model="simulated", total_bytes=limit_bytes, free_bytes=limit_bytes, simulated=True
    )
    return CardSpec(info=info, device="cpu")


def run_trial(
    task: Task,
    config: Mapping[str, Any],
    *,
    steps: int,
    eval_every: int | None = None,
    plan: Plan | None = None,
    limit_bytes: int = GIB,
    reporter: RecordingReporter | None = None,
) -> RunResult:
    """Train `config` for `steps` steps on a simulated CPU card with the worker's own loop."""
    budget = TrainBudget(max_steps=steps, eval_every=eval_every or steps)
    card, reporter = simulated_card(limit_bytes), reporter or RecordingReporter()
    with cpu_threads(1):
        return TorchTaskRunner(task).run(config, plan or Plan(), budget, card, reporter)


def check_task(
    task: Task,
    config: Mapping[str, Any],
    *,
    bad_configs: Iterable[Mapping[str, Any]] = (),
    device: str = "cpu",
    accumulation: bool = True,
) -> None:
    """Assert that `task` keeps the Task contract for `config` (a small, quick configuration).

    Args:
        task: the task under test.
        config: a configuration that builds; keep it small (the check runs a few steps) and
            without dropout (the accumulation check compares gradients exactly).
        bad_configs: configurations the task must refuse with TaskConfigError.
        device: where real batches and steps run.
        accumulation: also check that micro-batches with accumulation give the full batch's
            gradients (False for a model whose examples interact, e.g. through BatchNorm).
    """
    with cpu_threads(1):
        _check_task(task, config, list(bad_configs), torch.device(device), accumulation)


def _check_task(
    task: Task,
    config: Mapping[str, Any],
    bad_configs: list[Mapping[str, Any]],
    on: torch.device,
    accumulation: bool,
) -> None:
    check_declarations(task, config)
    check_model_and_optimizer(task, config)
    for micro in MICRO_SIZES:
        check_batches(task, config, micro, on)
    check_loss_and_evaluate(task, config, on)
    check_checkpointing(task, config, on)
    check_traceable(task, config)
    if accumulation:
        check_accumulation(task, config, on)
    for bad in bad_configs:
        check_refuses(task, bad)


def check_declarations(task: Task, config: Mapping[str, Any]) -> None:
    """The protocol's attributes are there and make sense."""
    assert isinstance(task, Task), f"{type(task).__name__} does not implement worker.task.Task"
    TypeAdapter(Name).validate_python(task.name)
    assert task.metric.direction in ("minimize", "maximize"), task.metric
    assert isinstance(task.shape_params, frozenset), "shape_params must be a frozenset"
    assert all(isinstance(key, str) for key in task.shape_params)
    assert task.batch_size_param not in task.shape_params, "the batch size is not a shape param"
    assert int(config[task.batch_size_param]) >= 2, "give a batch size of at least 2"


def check_model_and_optimizer(task: Task, config: Mapping[str, Any]) -> None:
    """The model builds on the CPU and the optimizer holds every trainable parameter."""
    model = task.build_model(config)
    assert isinstance(model, nn.Module)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable, "the model has no trainable parameters"
    assert all(p.device.type == "cpu" for p in model.parameters()), "build the model on the CPU"
    optimizer = task.build_optimizer(model, config)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert trainable <= optimized, "the optimizer misses some trainable parameters"


def check_batches(task: Task, config: Mapping[str, Any], micro: int, device: torch.device) -> None:
    """Real batches have `micro` examples on the device, repeat per seed, match example_batch."""
    first = next(iter(task.batches(config, micro, device, seed=0)))
    again = next(iter(task.batches(config, micro, device, seed=0)))
    assert isinstance(first, tuple) and first, "a batch is a non-empty tuple of tensors"
    for tensor, repeat in zip(first, again, strict=True):
        assert tensor.shape[0] == micro, f"asked for {micro} examples, got {tensor.shape[0]}"
        assert tensor.device.type == device.type, f"batch on {tensor.device}, not {device}"
        assert torch.equal(tensor, repeat), "the same seed must give the same batches"
    with FakeTensorMode():
        example = task.example_batch(config, micro, device)
    assert [(t.shape, t.dtype) for t in example] == [(t.shape, t.dtype) for t in first], (
        "example_batch must have the shapes and dtypes of real batches"
    )


def check_loss_and_evaluate(task: Task, config: Mapping[str, Any], device: torch.device) -> None:
    """The loss is a finite scalar with gradients; evaluate is a finite, repeatable float."""
    model = task.build_model(config).to(device)
    batch = next(iter(task.batches(config, MICRO_SIZES[-1], device, seed=0)))
    loss = task.loss(model, batch)
    assert loss.dim() == 0, f"the loss must be a scalar, got shape {tuple(loss.shape)}"
    assert math.isfinite(float(loss.detach())), f"the loss is {float(loss.detach())}"
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters()), (
        "the loss gives no gradient"
    )
    values = [_evaluate(task, model, config, device) for _ in range(2)]
    assert all(isinstance(v, float) and math.isfinite(v) for v in values), values
    assert values[0] == values[1], f"evaluate is not repeatable: {values}"


def _evaluate(
    task: Task, model: nn.Module, config: Mapping[str, Any], device: torch.device
) -> float:
    """evaluate as the worker calls it: eval mode, no gradients."""
    model.eval()
    with torch.no_grad():
        value = task.evaluate(model, config, device)
    model.train()
    return value


def check_checkpointing(task: Task, config: Mapping[str, Any], device: torch.device) -> None:
    """Checkpointable modules are the model's own, and recomputing them changes no loss."""
    model = task.build_model(config)
    modules = list(task.checkpoint_modules(model))
    owned = {id(m) for m in model.modules()}
    assert all(id(m) in owned for m in modules), "checkpoint_modules must be sub-modules"
    if not modules and getattr(task, "enable_checkpointing", None) is None:
        return
    losses = [
        _first_step_loss(task, config, Plan(checkpointing=flag), device) for flag in (False, True)
    ]
    assert torch.allclose(losses[0], losses[1]), f"checkpointing changed the loss: {losses}"


def _first_step_loss(
    task: Task, config: Mapping[str, Any], plan: Plan, device: torch.device
) -> torch.Tensor:
    """The loss of one seeded training step under `plan` on the first real batch."""
    batch_size = int(config[task.batch_size_param])
    torch.manual_seed(0)
    model = build_for_plan(task, config, plan, device)
    optimizer = task.build_optimizer(model, config)
    batch = next(iter(task.batches(config, batch_size, device, seed=0)))
    torch.manual_seed(1)  # the same dropout masks in both runs
    return train_step(task, model, optimizer, _slicer(batch), batch_size, plan, device)


def _slicer(batch: Batch) -> Callable[[int], Batch]:
    """`next_batch(size)` handing out consecutive slices of one fixed batch."""
    offset = 0

    def next_batch(size: int) -> Batch:
        nonlocal offset
        part = tuple(t[offset : offset + size] for t in batch)
        offset += size
        return part

    return next_batch


def check_traceable(task: Task, config: Mapping[str, Any]) -> None:
    """Two training steps run under a FakeTensorMode, as the predictor traces them."""
    batch_size = int(config[task.batch_size_param])
    device = torch.device("cpu")
    plan = Plan(micro_batch=max(1, batch_size // 2), accumulation=2)
    with FakeTensorMode():
        model = build_for_plan(task, config, plan, device)
        optimizer = task.build_optimizer(model, config)
        for _ in range(2):
            train_step(
                task,
                model,
                optimizer,
                lambda size: task.example_batch(config, size, device),
                batch_size,
                plan,
                device,
            )


def check_accumulation(task: Task, config: Mapping[str, Any], device: torch.device) -> None:
    """Gradients of the batch as uneven micro-batches equal the whole batch's."""
    batch_size = int(config[task.batch_size_param])
    batch = next(iter(task.batches(config, batch_size, device, seed=0)))
    micro = max(1, (batch_size + 1) // 2) if batch_size > 2 else 1
    grads = [
        gradients_after_one_step(task, config, batch, Plan(micro_batch=size), device)
        for size in (None, micro)
    ]
    for name, whole in grads[0].items():
        split = grads[1][name]
        assert torch.allclose(whole, split, rtol=1e-4, atol=1e-6), (
            f"micro-batches changed the gradient of {name}: max diff {(whole - split).abs().max()}"
        )


def gradients_after_one_step(
    task: Task, config: Mapping[str, Any], batch: Batch, plan: Plan, device: torch.device
) -> dict[str, torch.Tensor]:
    """The gradients one train_step leaves, from the same initial weights and examples."""
    torch.manual_seed(0)
    model = task.build_model(config).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # keep the gradients, move nothing
    torch.manual_seed(1)
    with cpu_threads(1):
        train_step(task, model, optimizer, _slicer(batch), len(batch[0]), plan, device)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_refuses(task: Task, config: Mapping[str, Any]) -> None:
    """An impossible configuration raises TaskConfigError with a message, not another error."""
    try:
        task.build_model(config)
    except TaskConfigError as error:
        assert str(error), "TaskConfigError needs a message the user can act on"
        return
    raise AssertionError(f"{task.name} built a model for the bad configuration {dict(config)}")
