"""Trace an evaluation after the training steps, as the run evaluates (issue 29).

The built-in trainer evaluates through `worker.trial.steps.evaluate_step`; the trace runs that
same function on the fake model the training steps left. A Hugging Face Trainer's `evaluate`
and a Lightning module's validation loop are traced by the same function, from inside their
own traced loops (vramtune/worker/integrations/). An evaluation is user code over real
held-out data, so two things differ from the training step's trace:

- Its data is real. An operator whose tensors are all real (loading, slicing, a label
  comparison) runs for real, outside the fake mode, so a data set the task caches stays real
  for the runs after the trace; where real data meets the fake model, the fake mode converts it.
  On a CUDA target a real tensor sent to the card becomes fake there.
- Its data may be loaded on first use and cached by the task. The evaluation runs twice: the
  first call, counted by nothing, loads it (as the runs after the trace find it loaded); the
  second is the one traced.
- Its metric is read in Python (`.item()`, `float()`, `int()`). Fake tensors have no values: a
  read answers zero. The metric is thrown away; only the memory is kept. Control flow that
  depends on those values (an early stop on the metric) is then traced as the zero path.

What cannot be traced this way (a data-dependent shape: `nonzero`, a boolean mask on the
model's output) leaves the evaluation bounded instead, and the prediction says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vramtune.worker.device.memory import EVALUATION_PHASE, MemoryTracker

UNTRACED_BOUND = (
    "evaluation not traced ({why}); bounded by the training step's peak, which holds when "
    "evaluate works in chunks of the batch size it is given (the plan's micro-batch)"
)
"""The reason a prediction carries when its evaluation could not be traced."""


class _RealDataMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Real operators on real data, zero for a fake scalar read (see the module docstring).

    Without `real_factories` an operator with no tensor input (`torch.empty`, `zeros`) stays
    fake: a framework's trace makes its batches fake that way. A tensor made from Python
    values (`torch.tensor(shape)`, whose values a framework reads back) is real either way."""

    def __init__(self, real_factories: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.real_factories = real_factories

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(leaf, FakeTensor) for leaf in leaves):
            if func is torch.ops.aten._local_scalar_dense.default:
                return _zero_of(args[0].dtype)
            return func(*args, **kwargs)
        made = not any(isinstance(leaf, torch.Tensor) for leaf in leaves)
        if (made and not self.real_factories) or _makes_a_card_tensor(kwargs):
            return func(*args, **kwargs)  # the fake mode converts the real inputs
        with unset_fake_temporarily():
            return func(*args, **kwargs)


def _makes_a_card_tensor(kwargs: dict[str, Any]) -> bool:
    """Whether an all-real operator makes a tensor on a device only the fake mode has (a
    held-out batch sent to the GPU, on a worker that traces on fake cuda)."""
    device = kwargs.get("device")
    return device is not None and torch.device(device).type != "cpu"


def _zero_of(dtype: torch.dtype) -> bool | int | float:
    if dtype is torch.bool:
        return False
    if dtype.is_floating_point or dtype.is_complex:
        return 0.0
    return 0


def trace_evaluation(
    evaluate: Callable[[], object],
    fake: FakeTensorMode,
    tracker: MemoryTracker,
    *,
    warm_up: bool = True,
    real_factories: bool = True,
) -> None:
    """Run `evaluate` (a task's `evaluate_step` on the traced model, a Trainer's `evaluate`, a
    Lightning module's validation loop) inside the trace's fake mode and tracker, its
    allocations in the tracker's evaluation phase. Raises whatever the evaluation raised.

    `warm_up` first runs it once uncounted, for a task that loads what it caches on first
    use (the runs find it loaded, and a data set is not memory a run allocates); a framework's
    data is loaded before its loop runs. `real_factories` runs the operators that make a tensor
    from nothing (a task's held-out set built on the fly) for real; without it they make fake
    tensors, as a framework's traced batches are made."""
    allowed = fake.allow_non_fake_inputs
    fake.allow_non_fake_inputs = True  # real held-out data meets the fake model
    try:
        with _RealDataMode(real_factories):
            if warm_up:
                with tracker.paused():
                    evaluate()
            with tracker.phase(EVALUATION_PHASE):
                evaluate()
    finally:
        fake.allow_non_fake_inputs = allowed
