"""A loop's repeated calls, replayed in a trace instead of run again (issue 43).

A Hugging Face Trainer's training loop calls `training_step` once per micro-batch, and its
evaluation loop `prediction_step` once per held-out batch: a batch of 512 in micro-batches of 1
with 512 held-out rows evaluated one by one ran the model 1,500 times under fake tensors, most
of a plan choice's minutes. The calls of one loop repeat: under fake tensors what a call
allocates follows from the shapes of what it is given and the Python state it reads, and in
these loops that state is the same from one batch to the next.

So a call is run and counted (`MemoryTracker.counting_block`) until two calls in a row with
the same signature (its arguments' shapes, dtypes and objects, and the loop's `context`: the
phase, grad mode, what the batch values answer...) were *clean* and counted the same:

- clean: it freed or resized nothing made before it, and what it made that is still live when
  it returns is exactly the tensors it returns (it keeps nothing elsewhere: a first call that
  creates gradients or fills a cache is not clean);
- counted the same: the same excess above the bytes live at its entry, and outputs of the same
  shapes made the same way (fresh and contiguous, or an input itself).

Each later call of that signature is replayed: its excess is counted on top of what is live
now (`MemoryTracker.count_transient`, the peak it would reach, which the loop's own growth,
such as the evaluation's gathered logits, still moves), and its outputs are made as the run
made them: a fresh output as an empty tensor of its shape (counted as the call's was), an
input passed through as that input. Only what the loop does around the calls (fetching the
next batch, gathering) runs, and it is counted as before. A CPU trace only: a CUDA trace keeps
every allocation event for the allocator model, which a replay does not make.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from vramtune.worker.device.memory import BlockCount, Excess, MemoryTracker
from vramtune.worker.trial.repeated import replaying


@dataclass(frozen=True)
class _Fresh:
    """An output the call made: an empty tensor of this shape, dtype and device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def make(self, inputs: list[Any]) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)


@dataclass(frozen=True)
class _Passed:
    """An output that is one of the call's input tensors (or a same-shaped view of it)."""

    index: int

    def make(self, inputs: list[Any]) -> torch.Tensor:
        given: torch.Tensor = inputs[self.index]
        return given.detach()


@dataclass(frozen=True)
class _Value:
    """An output that is no tensor (None, a number): returned as it was."""

    value: Any

    def make(self, inputs: list[Any]) -> Any:
        return self.value


_Output = _Fresh | _Passed | _Value


@dataclass(frozen=True)
class _Counted:
    """One clean call: its excess above the bytes live at its entry and how to make its outputs."""

    excess: Excess
    outputs: tuple[_Output, ...]
    spec: TreeSpec

    def same_as(self, other: _Counted | None) -> bool:
        return (
            other is not None
            and (self.excess, self.outputs) == (other.excess, other.outputs)
            and self.spec == other.spec
        )


@dataclass
class _Seen:
    """A signature's last clean call and how many clean calls in a row counted as it did."""

    counted: _Counted | None = None
    in_a_row: int = 0


REPLAY_AFTER = 2
"""Clean calls in a row, counted the same, before the next of that signature is replayed."""


class RepeatedCalls:
    """`call` (a bound method a loop calls repeatedly) that replays its repeats in a CPU trace.

    For a call whose allocations follow from its arguments and `context`, which gives what
    else decides them (see the module docstring): an argument that is neither a tensor nor a
    plain value (a model) counts by identity, so what it holds must keep its shapes from one
    call to the next. `run` and `replayed` count the calls each way (the tests read them).
    """

    def __init__(
        self,
        call: Callable[..., Any],
        tracker: MemoryTracker,
        context: Callable[[], Hashable],
        *,
        by_shape: bool = False,
    ) -> None:
        self.call = call
        self.tracker = tracker
        self.context = context
        self.by_shape = by_shape  # tensor arguments count by their shapes alone (`_signature`)
        self.seen: dict[Hashable, _Seen] = {}
        self.run = 0
        self.replayed = 0
        functools.update_wrapper(self, call)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, _ = tree_flatten((args, kwargs))
        signature = _signature(leaves, self.context(), self.by_shape)
        seen = self.seen.setdefault(signature, _Seen()) if signature is not None else None
        if seen is not None and seen.in_a_row >= REPLAY_AFTER and seen.counted is not None:
            self.replayed += 1
            return self._replay(seen.counted, leaves)
        self.run += 1
        with self.tracker.counting_block() as block:
            result = self.call(*args, **kwargs)
        if seen is not None:
            _note(seen, self._clean(block, leaves, result))
        return result

    def _replay(self, counted: _Counted, inputs: list[Any]) -> Any:
        self.tracker.count_transient(counted.excess)
        return tree_unflatten([output.make(inputs) for output in counted.outputs], counted.spec)

    def _clean(self, block: BlockCount, inputs: list[Any], result: Any) -> _Counted | None:
        """What the call counted, when it was clean (see the module docstring); else None."""
        if block.freed_older:
            return None
        leaves, spec = tree_flatten(result)
        outputs: list[_Output] = []
        made: set[int] = set()
        for leaf in leaves:
            output = self._output(leaf, inputs, block, made)
            if output is None:
                return None
            outputs.append(output)
        if made != set(block.made):
            return None  # it keeps something besides its outputs
        return _Counted(block.excess(), tuple(outputs), spec)

    def _output(
        self, leaf: Any, inputs: list[Any], block: BlockCount, made: set[int]
    ) -> _Output | None:
        """How a replay makes this output; None when it cannot make it the same way. A
        fresh output's storage is added to `made`."""
        if not isinstance(leaf, torch.Tensor):
            return _Value(leaf) if _plain_value(leaf) else None
        if not isinstance(leaf, FakeTensor) or leaf.requires_grad:
            return None
        storage = self.tracker.storage_id(leaf)
        if storage is not None and storage in block.made:
            if storage in made or not _whole_storage(leaf):
                return None  # two outputs in one storage, or a view into a larger one
            made.add(storage)
            return _Fresh(tuple(leaf.shape), leaf.dtype, leaf.device)
        for index, given in enumerate(inputs):
            if isinstance(given, torch.Tensor) and _same_view(leaf, given):
                return _Passed(index)
        if storage is None and self.tracker.is_paused and _whole_storage(leaf):
            # Nothing is counted now (an evaluation's warm-up): a new tensor is made uncounted.
            return _Fresh(tuple(leaf.shape), leaf.dtype, leaf.device)
        return None


def _note(seen: _Seen, counted: _Counted | None) -> None:
    """Count a run call in its signature's row of clean calls counted the same."""
    if counted is None:
        seen.counted, seen.in_a_row = None, 0
    elif counted.same_as(seen.counted):
        seen.in_a_row += 1
    else:
        seen.counted, seen.in_a_row = counted, 1


def _signature(leaves: list[Any], context: Hashable, by_shape: bool) -> Hashable | None:
    """What decides a call's allocations: each argument's shape, strides, offset, dtype and
    device (a tensor), value (a plain value) or identity (any other object: a model, a list of
    keys), and the context; None (never replayed) for a tensor that is not fake.

    `by_shape`: the caller says values and offsets decide nothing (a loop over the chunks of
    one tensor, real held-out targets among them): a tensor counts by its shape, strides,
    dtype and device, real or fake.
    """
    described: list[Hashable] = [context]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if not isinstance(leaf, FakeTensor) and not by_shape:
                return None
            offset = None if by_shape else leaf.storage_offset()
            described.append(
                (
                    tuple(leaf.shape),
                    leaf.stride(),
                    offset,
                    leaf.dtype,
                    leaf.device,
                    leaf.requires_grad,
                )
            )
        elif _plain_value(leaf):
            described.append((type(leaf), leaf))
        else:
            described.append((type(leaf), id(leaf)))
    return tuple(described)


def _plain_value(value: object) -> bool:
    return value is None or type(value) in (bool, int, float, str)


def _whole_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is contiguous and fills its storage (an empty one is made the same)."""
    nbytes = tensor.untyped_storage().nbytes()
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and nbytes == tensor.numel() * tensor.element_size()
    )


def _same_view(output: torch.Tensor, given: torch.Tensor) -> bool:
    """Whether `output` is `given` or a view of it with the same shape, strides and dtype."""
    return (
        output.untyped_storage()._cdata == given.untyped_storage()._cdata
        and output.shape == given.shape
        and output.stride() == given.stride()
        and output.storage_offset() == given.storage_offset()
        and output.dtype == given.dtype
    )


@contextmanager
def replayed(tracker: MemoryTracker) -> Iterator[dict[Callable[..., Any], RepeatedCalls]]:
    """Inside the block, the calls task code marks `repeated` (vramtune/worker/trial/repeated.py)
    replay their repeats: one `RepeatedCalls` per marked function (yielded, by function), its
    tensor arguments counted by their shapes. For a CPU trace only, as every replay here."""
    calls: dict[Callable[..., Any], RepeatedCalls] = {}

    def context() -> Hashable:
        # What else decides a marked call's allocations: whether anything is counted (the
        # evaluation's uncounted warm-up counts nothing), the phase and the modes.
        return (
            tracker.is_paused,
            tracker.current_phase(),
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            torch._C._is_any_autocast_enabled(),
        )

    def wrap(call: Callable[..., Any]) -> Callable[..., Any]:
        if call not in calls:
            calls[call] = RepeatedCalls(call, tracker, context, by_shape=True)
        return calls[call]

    with replaying(wrap):
        yield calls
