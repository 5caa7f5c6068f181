"""The Task contract, checked: what the worker and the predictor rely on a task to do.

`vramtune tasks check FILE` runs these checks on a user's own task before any trial does, and
the test suite runs them on every built-in task (`check_task`). Each check names the member it
exercises and the rule it found broken: the declared attributes make sense, the model builds
(also under a FakeTensorMode, as the predictor builds it), ``example_batch`` has the shapes and
dtypes of real batches, the loss is a finite scalar with gradients, ``evaluate`` returns a
finite, repeatable float, checkpointable modules are sub-modules and recomputing them changes
no loss, a traced training step needs no tensor values, micro-batches with accumulation give
the whole batch's gradients, and configurations the task calls impossible raise
``TaskConfigError``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import TypeAdapter, ValidationError
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from vramtune.service.wire import CategoricalParam, Name, Plan, StudyCreate
from vramtune.worker.predictor.conversion import build_for_trace
from vramtune.worker.trial.rungs import task_can_checkpoint
from vramtune.worker.trial.runner import trial_config
from vramtune.worker.trial.steps import build_for_plan, build_optimizer_for_plan, train_step
from vramtune.worker.trial.task import Batch, Task, TaskConfigError

Config = Mapping[str, Any]
MICRO_SIZES = (1, 3)
Check = Callable[[Task, Config, torch.device], str | None]
"""A check: raises `ContractBroken` on a broken rule, else returns None or a note to print."""
NO_CHECKPOINTING = (
    "none: the task marks no modules (override checkpoint_modules to let plans recompute "
    "activations); plans resize without the checkpointing rungs"
)


class ContractBroken(AssertionError):
    """A rule of the Task contract that a task breaks; the message names the member."""


def require(condition: object, member: str, rule: str) -> None:
    """Raise `ContractBroken` naming `member` and the `rule` it breaks unless `condition`."""
    if not condition:
        raise ContractBroken(f"{member}: {rule}")


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


def check_task(
    task: Task,
    config: Config,
    *,
    bad_configs: Iterable[Config] = (),
    device: str = "cpu",
    accumulation: bool = True,
) -> None:
    """Raise `ContractBroken` (an AssertionError) on the first rule `task` breaks for `config`.

    Args:
        task: the task under test.
        config: a configuration that builds; keep it small (the check runs a few steps) and
            without dropout (the accumulation check compares gradients exactly).
        bad_configs: configurations the task must refuse with TaskConfigError.
        device: where real batches and steps run.
        accumulation: also check that micro-batches with accumulation give the full batch's
            gradients (False for a model whose examples interact, e.g. through BatchNorm).
    """
    on = torch.device(device)
    with cpu_threads(1):
        for check in checks(accumulation):
            check(task, config, on)
        for bad in bad_configs:
            check_refuses(task, bad)


@dataclass(frozen=True)
class Finding:
    """One check's outcome for `vramtune tasks check`: passed, or the rule found broken."""

    check: str
    problem: str | None = None
    note: str | None = None
    """What a kept check found worth saying (e.g. that the task has nothing to checkpoint)."""

    @property
    def passed(self) -> bool:
        """Whether the check found its rules kept."""
        return self.problem is None


def run_checks(task: Task, config: Config, device: str = "cpu") -> list[Finding]:
    """The checks on `task` up to the first broken one, each reported rather than raised."""
    on = torch.device(device)
    findings: list[Finding] = []
    with cpu_threads(1):
        for check in checks(accumulation=True):
            findings.append(_finding(check, task, config, on))
            if not findings[-1].passed:  # later checks build on this one: stop here
                break
    return findings


def _finding(
    check: Check,
    task: Task,
    config: Config,
    on: torch.device,
) -> Finding:
    name = check.__name__.removeprefix("check_").replace("_", " ")
    try:
        note = check(task, config, on)
    except ContractBroken as broken:
        return Finding(name, str(broken))
    except Exception as error:  # the user's code raised: say where, not only what
        return Finding(name, f"raised {type(error).__name__}: {error}")
    return Finding(name, note=note if isinstance(note, str) else None)


def checks(accumulation: bool) -> list[Check]:
    """The checks in the order they build on each other."""
    found: list[Check] = [
        check_declarations,
        check_model_and_optimizer,
        check_batches,
        check_loss_and_evaluate,
        check_checkpointing,
        check_traceable,
    ]
    return [*found, check_accumulation] if accumulation else found


def check_declarations(task: Task, config: Config, on: torch.device) -> None:
    """The protocol's attributes are there and make sense."""
    require(isinstance(task, Task), type(task).__name__, "does not implement the Task protocol")
    try:
        TypeAdapter(Name).validate_python(task.name)
    except ValidationError:
        raise ContractBroken(f"name: {task.name!r} is not letters, digits, '._-'") from None
    require(
        task.metric.direction in ("minimize", "maximize"),
        "metric",
        f"direction must be 'minimize' or 'maximize', not {task.metric.direction!r}",
    )
    require(isinstance(task.shape_params, frozenset), "shape_params", "must be a frozenset")
    require(all(isinstance(k, str) for k in task.shape_params), "shape_params", "holds keys")
    require(
        task.batch_size_param not in task.shape_params,
        "shape_params",
        f"must not hold the batch size {task.batch_size_param!r} (it is split, not a shape)",
    )
    require(
        task.batch_size_param in config,
        "batch_size_param",
        f"the configuration has no {task.batch_size_param!r}",
    )
    require(int(config[task.batch_size_param]) >= 2, "config", "give a batch size of at least 2")


def check_model_and_optimizer(task: Task, config: Config, on: torch.device) -> None:
    """The model builds on the CPU and the optimizer holds every trainable parameter."""
    model = task.build_model(config)
    require(isinstance(model, nn.Module), "build_model", "must return an nn.Module")
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    require(trainable, "build_model", "the model has no trainable parameters")
    require(
        all(p.device.type == "cpu" for p in model.parameters()),
        "build_model",
        "build the model on the CPU; the worker moves it",
    )
    optimizer = task.build_optimizer(model, config)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    require(trainable <= optimized, "build_optimizer", "misses some trainable parameters")


def check_batches(task: Task, config: Config, on: torch.device) -> None:
    """Real batches have the asked number of examples on the device, repeat per seed, and match
    example_batch's shapes and dtypes."""
    for micro in MICRO_SIZES:
        first = next(iter(task.batches(config, micro, on, seed=0)))
        again = next(iter(task.batches(config, micro, on, seed=0)))
        require(isinstance(first, tuple) and first, "batches", "yield tuples of tensors")
        for tensor, repeat in zip(first, again, strict=True):
            require(
                tensor.shape[0] == micro,
                "batches",
                f"asked for {micro} examples, got {tensor.shape[0]}",
            )
            require(tensor.device.type == on.type, "batches", f"on {tensor.device}, not {on}")
            require(torch.equal(tensor, repeat), "batches", "the same seed must repeat batches")
        with FakeTensorMode():
            example = task.example_batch(config, micro, on)
        require(
            [(t.shape, t.dtype) for t in example] == [(t.shape, t.dtype) for t in first],
            "example_batch",
            "must have the shapes and dtypes of real batches",
        )


def check_loss_and_evaluate(task: Task, config: Config, on: torch.device) -> None:
    """The loss is a finite scalar with gradients; evaluate is a finite, repeatable float."""
    model = task.build_model(config).to(on)
    batch = next(iter(task.batches(config, MICRO_SIZES[-1], on, seed=0)))
    loss = task.loss(model, batch)
    require(loss.dim() == 0, "loss", f"must be a scalar, got shape {tuple(loss.shape)}")
    require(math.isfinite(float(loss.detach())), "loss", f"is {float(loss.detach())}")
    loss.backward()  # type: ignore[no-untyped-call]
    require(
        any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters()),
        "loss",
        "gives no gradient",
    )
    values = [evaluate_as_worker(task, model, config, on) for _ in range(2)]
    require(
        all(isinstance(v, float) and math.isfinite(v) for v in values),
        "evaluate",
        f"must return a finite float, returned {values[0]!r}",
    )
    require(values[0] == values[1], "evaluate", f"is not repeatable: {values}")


def evaluate_as_worker(task: Task, model: nn.Module, config: Config, on: torch.device) -> float:
    """evaluate as the worker calls it: eval mode, no gradients."""
    model.eval()
    with torch.no_grad():
        value = task.evaluate(model, config, on)
    model.train()
    return value


def check_checkpointing(task: Task, config: Config, on: torch.device) -> str | None:
    """Checkpointable modules are the model's own, and recomputing them changes no loss; a task
    that has none says so (its plans resize without the rung: worker/trial/rungs.py)."""
    if not task_can_checkpoint(task):
        return NO_CHECKPOINTING
    model = task.build_model(config)
    modules = list(task.checkpoint_modules(model))
    owned = {id(m) for m in model.modules()}
    require(all(id(m) in owned for m in modules), "checkpoint_modules", "return sub-modules")
    if not modules and getattr(task, "enable_checkpointing", None) is None:
        # A plan with checkpointing would fail the trial ("marks no modules"): the task must
        # say it has none rather than claim the rung.
        raise ContractBroken(
            "checkpoint_modules: returns no modules for this configuration: return the blocks "
            "to recompute, or set can_checkpoint = False so plans never ask for checkpointing"
        )
    losses = [first_step_loss(task, config, Plan(checkpointing=flag), on) for flag in (False, True)]
    require(
        torch.allclose(losses[0], losses[1]),
        "checkpoint_modules",
        f"recomputing them changed the loss: {[float(x) for x in losses]}",
    )
    return None


def first_step_loss(task: Task, config: Config, plan: Plan, on: torch.device) -> torch.Tensor:
    """The loss of one seeded training step under `plan` on the first real batch."""
    batch_size = int(config[task.batch_size_param])
    torch.manual_seed(0)
    model = build_for_plan(task, config, plan, on)
    optimizer = build_optimizer_for_plan(task, model, config, plan)
    batch = next(iter(task.batches(config, batch_size, on, seed=0)))
    torch.manual_seed(1)  # the same dropout masks in both runs
    return train_step(task, model, optimizer, slicer(batch), batch_size, plan, on)


def slicer(batch: Batch) -> Callable[[int], Batch]:
    """`next_batch(size)` handing out consecutive slices of one fixed batch."""
    offset = 0

    def next_batch(size: int) -> Batch:
        nonlocal offset
        part = tuple(t[offset : offset + size] for t in batch)
        offset += size
        return part

    return next_batch


def check_traceable(task: Task, config: Config, on: torch.device) -> None:
    """Two training steps run under a FakeTensorMode, as the predictor traces them (a model
    that cannot be built there is built outside it and converted, as the predictor does)."""
    batch_size = int(config[task.batch_size_param])
    cpu = torch.device("cpu")
    plan = Plan(micro_batch=max(1, batch_size // 2), accumulation=2)
    with FakeTensorMode():
        model = build_for_trace(task, config, plan, cpu)
        optimizer = task.build_optimizer(model, config)
        for _ in range(2):
            train_step(
                task,
                model,
                optimizer,
                lambda size: task.example_batch(config, size, cpu),
                batch_size,
                plan,
                cpu,
            )


def check_accumulation(task: Task, config: Config, on: torch.device) -> None:
    """Gradients of the batch as uneven micro-batches equal the whole batch's."""
    batch_size = int(config[task.batch_size_param])
    batch = next(iter(task.batches(config, batch_size, on, seed=0)))
    micro = max(1, (batch_size + 1) // 2) if batch_size > 2 else 1
    grads = [
        gradients_after_one_step(task, config, batch, Plan(micro_batch=size), on)
        for size in (None, micro)
    ]
    for name, whole in grads[0].items():
        split = grads[1][name]
        require(
            torch.allclose(whole, split, rtol=1e-4, atol=1e-6),
            "loss",
            f"micro-batches changed the gradient of {name} by up to "
            f"{float((whole - split).abs().max()):.3g}: return the batch's mean loss",
        )


def gradients_after_one_step(
    task: Task, config: Config, batch: Batch, plan: Plan, on: torch.device
) -> dict[str, torch.Tensor]:
    """The gradients one train_step leaves, from the same initial weights and examples."""
    torch.manual_seed(0)
    model = task.build_model(config).to(on)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # keep the gradients, move nothing
    torch.manual_seed(1)
    with cpu_threads(1):
        train_step(task, model, optimizer, slicer(batch), len(batch[0]), plan, on)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_refuses(task: Task, config: Config) -> None:
    """An impossible configuration raises TaskConfigError with a message, not another error."""
    try:
        task.build_model(config)
    except TaskConfigError as error:
        require(str(error), "build_model", "TaskConfigError needs a message the user can act on")
        return
    raise ContractBroken(f"build_model: built a model for the bad configuration {dict(config)}")


def smallest_config(study: StudyCreate) -> dict[str, Any]:
    """A study's cheapest configuration: every number at its low end, every category's first
    choice (studies list names smallest first), over the study's task_config."""
    params: dict[str, Any] = {}
    for name, param in study.search_space.items():
        params[name] = param.choices[0] if isinstance(param, CategoricalParam) else param.low
    return trial_config(study.task_config, params)


def format_findings(task_name: str, findings: list[Finding]) -> str:
    """What `vramtune tasks check` prints for one task: a line per check."""
    lines = [f"{task_name}:"]
    for finding in findings:
        mark = "ok  " if finding.passed else "FAIL"
        said = finding.problem or finding.note
        lines.append(f"  {mark}  {finding.check}" + (f": {said}" if said else ""))
    return "\n".join(lines)
