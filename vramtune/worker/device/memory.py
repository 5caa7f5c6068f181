"""Live tensor memory of a training run, counted storage by storage.

`MemoryTracker` is a `TorchDispatchMode`: every storage an operator creates is counted once
(views share their storage), rounded up as the CUDA caching allocator rounds requests, and
uncounted when it dies (a weakref finalizer on the storage). It works on real tensors (the CPU
trainer's measured peak, the simulated card of ``--memory-limit``) and under a
`FakeTensorMode` (the predictor's trace): it is the one byte counter of the project, so on a
CPU build the predicted peak equals the measured one to the byte. Where a fake kernel's output
is smaller than the real one (oneDNN's RNN workspace), the trace passes a `correct` hook that
fixes the output before it is counted, in this same mode.

Typical use in a training loop::

    tracker = MemoryTracker(device_type="cpu", limit_bytes=card_bytes)
    with tracker:                      # enter inside a FakeTensorMode, never outside it
        model = build_for_plan(task, config, plan, device)
        optimizer = build_optimizer_for_plan(task, model, config, plan)
        tracker.watch_optimizer(optimizer)
        for _ in range(steps):
            train_step(...)            # raises MemoryLimitExceeded past the limit
            tracker.label_training_state(model, optimizer)
    tracker.peak_bytes, tracker.breakdown()

`UntypedStorage.resize_` is no operator, so no dispatch mode sees it: while a tracker is entered
it is wrapped (`_watch_resizes`), and a counted storage resized in place is counted at its new
size from then on. FSDP2 frees each all-gathered parameter with ``resize_(0)`` after forward and
re-materialises it with ``resize_(n)`` before backward; unseen, those bytes stayed counted, and
FSDP2's peak was over-counted by 0.4-13.8 % (issue 31's benchmark), on real ranks and in the
trace alike.

Tensors created before the tracker is entered are not counted unless passed to `track`, nor
are views of them (a slice of a dataset loaded before the run is not memory the run allocated:
counting it was the constant 95,232 bytes the digits study's evaluation added to every measured
peak, issue 18).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_leaves

CUDA_ALLOCATION_ROUNDING = 512
"""The CUDA caching allocator rounds every request up to a multiple of 512 bytes."""

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
"""The breakdown of a peak: labelled training state, then what forward left alive, then the rest."""

PHASES = ("setup", "forward", "backward", "optimizer", "evaluation")
"""Where a storage was created; `phase` and `watch_optimizer` set it, backward is detected."""

EVALUATION_PHASE = "evaluation"
"""The phase of a task's `evaluate` (measured and predicted apart from the training step's)."""

Correction = Callable[[Any, tuple[Any, ...], Any], Any]
"""`correct(func, args, out)`: the output to count instead of `out` (a fake kernel's fix)."""


@functools.cache
def _aliases_an_input(func: Any) -> bool:
    """Whether the operator returns (a view of) an input: views, in-place and out= variants.

    lift_fresh is excluded: it is how `torch.tensor(data)` hands a tensor it just made to the
    dispatcher, a new allocation.
    """
    if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
        return False
    schema = getattr(func, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


class MemoryLimitExceeded(torch.OutOfMemoryError):
    """Live tensor bytes would pass the tracker's limit: the simulated card is out of memory.

    It subclasses `torch.OutOfMemoryError`, so one ``except torch.OutOfMemoryError`` catches
    a real CUDA OOM and the simulated one alike.
    """

    def __init__(self, requested: int, live: int, limit: int) -> None:
        super().__init__(
            f"simulated card out of memory: tried to allocate {_mib(requested)} with "
            f"{_mib(live)} live of a {_mib(limit)} limit"
        )
        self.requested = requested
        self.live = live
        self.limit = limit

    def __reduce__(self) -> tuple[type[MemoryLimitExceeded], tuple[int, int, int]]:
        return type(self), (self.requested, self.live, self.limit)


def round_up(nbytes: int, multiple: int) -> int:
    """`nbytes` rounded up to a multiple of `multiple` (0 stays 0, as a CUDA empty tensor)."""
    if multiple <= 1:
        return nbytes
    return -(-nbytes // multiple) * multiple


@dataclass(slots=True)
class _Storage:
    """One counted storage: its size, where it was made, and when it lived (event ticks)."""

    rid: int
    key: int
    nbytes: int
    phase: str
    born: int
    died: int | None = None
    ref: weakref.ref[torch.UntypedStorage] | None = None


@dataclass(frozen=True)
class Excess:
    """How far a block of allocations went above the bytes live at its start: at its highest
    (`total`), while each phase allocated (`phases`, as `MemoryTracker.phase_peaks`), and the
    breakdown categories of what it held at its highest (`categories`)."""

    total: int
    phases: tuple[tuple[str, int], ...]
    categories: tuple[tuple[str, int], ...]


@dataclass
class BlockCount:
    """What a tracker counted inside one `MemoryTracker.counting_block` block (a call of a
    traced loop, to replay it: vramtune/worker/predictor/repeats.py).

    `made`: the storages made inside it still live (id: category, bytes); `freed_older`:
    whether a storage made before it died or was resized in it (then what it left is more
    than `made` tells)."""

    entry_tick: int
    live_at_entry: int
    highest: int
    made: dict[int, tuple[str, int]] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    """The bytes of `made` by category."""
    freed_older: bool = False
    phases: dict[str, int] = field(default_factory=dict)
    held_at_highest: dict[str, int] = field(default_factory=dict)

    def excess(self) -> Excess:
        """What it allocated above the bytes live at its entry (`Excess`)."""
        entry = self.live_at_entry
        return Excess(
            self.highest - entry,
            tuple(sorted((phase, live - entry) for phase, live in self.phases.items())),
            tuple(sorted((c, n) for c, n in self.held_at_highest.items() if n)),
        )

    def add(self, rid: int, category: str, nbytes: int) -> None:
        """A storage made inside the block."""
        self.made[rid] = (category, nbytes)
        self.held[category] = self.held.get(category, 0) + nbytes

    def drop(self, record: _Storage) -> None:
        """A storage died (or was resized): one made before the block, or one of `made`."""
        if record.born <= self.entry_tick:
            self.freed_older = True
        elif record.rid in self.made:
            category, nbytes = self.made.pop(record.rid)
            self.held[category] -= nbytes

    def reached(self, phase: str, live: int, replayed: Excess | None = None) -> None:
        """Live bytes rose to `live` while `phase` allocated; `replayed`: a replayed call's
        excess is live then, beside what the block holds."""
        self.phases[phase] = max(self.phases.get(phase, 0), live)
        if live > self.highest:
            self.highest = live
            self.held_at_highest = dict(self.held)
            for category, nbytes in replayed.categories if replayed is not None else ():
                self.held_at_highest[category] = self.held_at_highest.get(category, 0) + nbytes


class MemoryTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts live storages; `peak_bytes` is the highest `live_bytes` since the last reset.

    Args:
        round_to: each storage counts as its size rounded up to this (512 like CUDA; 1 for
            exact bytes).
        limit_bytes: raise `MemoryLimitExceeded` when an operator's new storages would take
            live bytes past this (the storages are dropped, nothing is counted).
        device_type: count only storages on this device type ("cpu", "cuda"); None counts
            every device but meta.
        record_events: keep the allocation/free sequence in `events` (for the allocator model).
        correct: applied to each operator's output before it is counted (see `Correction`).

    `phase_peaks` holds the highest live bytes reached while each phase allocated: the peak is
    the largest of them, and each is affine in the micro-batch (the predictor solves on them).
    """

    def __init__(
        self,
        *,
        round_to: int = CUDA_ALLOCATION_ROUNDING,
        limit_bytes: int | None = None,
        device_type: str | None = None,
        record_events: bool = False,
        correct: Correction | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.round_to = round_to
        self.limit_bytes = limit_bytes
        self.device_type = device_type
        self.live_bytes = 0
        self.peak_bytes = 0
        self.events: list[tuple[int, int]] | None = [] if record_events else None
        """(storage id, +requested bytes) per allocation, (storage id, -counted bytes) per free."""
        self._live: dict[int, _Storage] = {}
        self._history: list[_Storage] = []
        self._pruned_at = 64
        self._labels: dict[int, str] = {}
        self._tick = 0
        self._peak_tick = 0
        self._next_rid = 0
        self._phase: str | None = None
        self._correct = correct
        self._paused = False
        self.phase_peaks: dict[str, int] = {}
        self._blocks: list[BlockCount] = []
        # What a replayed call held at the peak it set (`count_transient`), by category: no
        # storage of the history stands for it.
        self._peak_transient: dict[str, int] | None = None

    # ------------------------------------------------------------------ dispatch

    def __enter__(self) -> MemoryTracker:
        _RESIZE_WATCHERS.append(self)
        _watch_resizes()
        try:
            super().__enter__()  # type: ignore[no-untyped-call]
        except BaseException:
            _RESIZE_WATCHERS.remove(self)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)  # type: ignore[no-untyped-call]
        finally:
            _RESIZE_WATCHERS.remove(self)

    def _storage_resized(self, storage: torch.UntypedStorage) -> None:
        """A storage was resized in place (`UntypedStorage.resize_`): count its new size.

        Only a storage counted already is followed: one made before the tracker was entered
        stays uncounted, as its tensors' views do.
        """
        known = self._live.get(id(storage))
        if known is not None and not self._paused:
            self._maybe_resized(known, storage)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        if self._correct is not None:
            out = self._correct(func, args, out)
        self._count(tree_leaves(out), fresh_only=_aliases_an_input(func))
        return out

    def track(self, *objects: torch.Tensor | nn.Module | torch.optim.Optimizer) -> None:
        """Count storages that exist already (a model built before the tracker was entered)."""
        for obj in objects:
            if isinstance(obj, nn.Module):
                self._count([*obj.parameters(), *obj.buffers()])
            elif isinstance(obj, torch.optim.Optimizer):
                self._count(_optimizer_tensors(obj))
            else:
                self._count([obj])
            self._label_object(obj)

    def _count(self, leaves: list[Any], fresh_only: bool = False) -> None:
        """Count the storages of `leaves` not counted yet.

        With `fresh_only` (an operator that returns an input) an unknown storage existed before
        the tracker saw it: it is not counted, only a known one's growth (resize_) is.
        """
        new: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for leaf in _plain_tensors(leaves):
            storage = self._storage_of(leaf)
            if storage is None:
                continue
            key = id(storage)
            known = self._live.get(key)
            if known is not None:
                self._maybe_resized(known, storage)
            elif not fresh_only and key not in new:
                new[key] = (storage, storage.nbytes())
        if not new:
            return
        requested = sum(round_up(n, self.round_to) for _, n in new.values())
        if self.limit_bytes is not None and self.live_bytes + requested > self.limit_bytes:
            raise MemoryLimitExceeded(requested, self.live_bytes, self.limit_bytes)
        for key, (storage, nbytes) in new.items():
            self._add(key, storage, nbytes)
        self._update_peak()

    def _storage_of(self, leaf: Any) -> torch.UntypedStorage | None:
        if not isinstance(leaf, torch.Tensor) or leaf.device.type == "meta":
            return None
        if self.device_type is not None and leaf.device.type != self.device_type:
            return None
        try:
            return leaf.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested: no plain storage
            return None

    def _add(self, key: int, storage: torch.UntypedStorage, nbytes: int) -> None:
        self._tick += 1
        record = _Storage(
            rid=self._next_rid,
            key=key,
            nbytes=round_up(nbytes, self.round_to),
            phase=self.current_phase(),
            born=self._tick,
        )
        self._next_rid += 1
        record.ref = weakref.ref(storage, functools.partial(self._free, record))
        self._live[key] = record
        self._history.append(record)
        self.live_bytes += record.nbytes
        for block in self._blocks:
            block.add(record.rid, self._category(record), record.nbytes)
        if self.events is not None and nbytes:
            self.events.append((record.rid, nbytes))

    def _maybe_resized(self, record: _Storage, storage: torch.UntypedStorage) -> None:
        # resize_/set_ grow or shrink a storage in place; count the new size from now on.
        nbytes = round_up(storage.nbytes(), self.round_to)
        if nbytes == record.nbytes:
            return
        if (
            self.limit_bytes is not None
            and self.live_bytes + nbytes - record.nbytes > self.limit_bytes
        ):
            raise MemoryLimitExceeded(nbytes - record.nbytes, self.live_bytes, self.limit_bytes)
        self._free(record, None)
        self._add(record.key, storage, storage.nbytes())
        self._update_peak()

    def _free(self, record: _Storage, _ref: object) -> None:
        if record.died is not None:
            return
        self._tick += 1
        record.died = self._tick
        self.live_bytes -= record.nbytes
        if self._live.get(record.key) is record:
            del self._live[record.key]
        for block in self._blocks:
            block.drop(record)
        if self.events is not None and record.nbytes:
            self.events.append((record.rid, -record.nbytes))

    def _update_peak(self) -> None:
        phase = self.current_phase()
        if self.live_bytes > self.phase_peaks.get(phase, 0):
            self.phase_peaks[phase] = self.live_bytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self._peak_tick = self._tick
            self._peak_transient = None
        for block in self._blocks:
            block.reached(phase, self.live_bytes)
        if len(self._history) > 2 * self._pruned_at:
            self._prune_history()

    def _prune_history(self) -> None:
        # A storage dead before the peak, or born and dead after it, can never be live at a
        # peak again: drop it so a long training run keeps only live storages and the peak's.
        self._history = [r for r in self._history if r.died is None or self._alive_at_peak(r)]
        self._pruned_at = max(64, len(self._history))

    def _alive_at_peak(self, record: _Storage) -> bool:
        return record.born <= self._peak_tick and (
            record.died is None or record.died > self._peak_tick
        )

    # ------------------------------------------------------------------ phases, labels

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self.phase_peaks = {}
        self.peak_bytes = self.live_bytes
        self._peak_tick = self._tick
        self._peak_transient = None

    @contextmanager
    def counting_block(self) -> Iterator[BlockCount]:
        """Count what the block allocates apart (see `BlockCount`), besides counting it."""
        block = BlockCount(self._tick, self.live_bytes, self.live_bytes)
        self._blocks.append(block)
        try:
            yield block
        finally:
            self._blocks.remove(block)

    def count_transient(self, excess: Excess) -> None:
        """Count a call replayed instead of run (`BlockCount.excess` of one run before it): its
        allocations above what is live now, made and freed with no storage. The peaks, phase
        peaks and breakdown are those the call's own storages would give."""
        if self._paused or not excess.phases:
            return  # it allocated nothing
        base = self.live_bytes
        if self.limit_bytes is not None and base + excess.total > self.limit_bytes:
            raise MemoryLimitExceeded(excess.total, base, self.limit_bytes)
        self._tick += 1
        for phase, above in excess.phases:
            self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), base + above)
        highest = base + excess.total
        if highest > self.peak_bytes:
            self.peak_bytes = highest
            self._peak_tick = self._tick
            self._peak_transient = dict(excess.categories)
        for block in self._blocks:
            # The highest first: a phase's level can be the call's highest too.
            for phase, above in sorted(excess.phases, key=lambda p: -p[1]):
                block.reached(phase, base + above, excess if above == excess.total else None)

    def storage_id(self, tensor: torch.Tensor) -> int | None:
        """The id of the counted storage `tensor` lives in (a `BlockCount.made` key); None
        when it is not counted."""
        storage = self._storage_of(tensor)
        record = None if storage is None else self._live.get(id(storage))
        return None if record is None else record.rid

    def current_phase(self) -> str:
        """The phase new storages are attributed to."""
        if self._phase is not None:
            return self._phase
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward"

    @property
    def is_paused(self) -> bool:
        """Whether nothing is counted now (inside `paused`)."""
        return self._paused

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Count nothing created inside the block: it is as if made before the tracker."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute storages created inside the block to phase `name`."""
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    def watch_optimizer(self, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        """Attribute what `optimizer.step()` creates to the "optimizer" phase; returns an undo."""

        def enter(*_: object) -> None:
            self._phase = "optimizer"

        def leave(*_: object) -> None:
            self._phase = None

        handles = [
            optimizer.register_step_pre_hook(enter),
            optimizer.register_step_post_hook(leave),
        ]

        def remove() -> None:
            for handle in handles:
                handle.remove()

        return remove

    def label(self, category: str, tensors: list[torch.Tensor]) -> None:
        """Mark the storages of `tensors` (counted already) as `category` in the breakdown."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; use one of {CATEGORIES}")
        for tensor in _plain_tensors(tensors):
            storage = self._storage_of(tensor)
            record = None if storage is None else self._live.get(id(storage))
            if record is not None:
                self._labels[record.rid] = category

    def label_training_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Label parameters and buffers, gradients and optimizer state; call after each step."""
        self._label_object(model)
        if optimizer is not None:
            self._label_object(optimizer)

    def _label_object(self, obj: object) -> None:
        if isinstance(obj, nn.Module):
            self.label("parameters", [*obj.parameters(), *obj.buffers()])
            self.label("gradients", [p.grad for p in obj.parameters() if p.grad is not None])
        elif isinstance(obj, torch.optim.Optimizer):
            self.label("optimizer_state", _optimizer_tensors(obj))

    def breakdown(self) -> dict[str, int]:
        """Bytes live at the peak by category (labels first, then the phase that made them)."""
        totals = dict.fromkeys(CATEGORIES, 0)
        for record in self._history:
            if self._alive_at_peak(record):
                totals[self._category(record)] += record.nbytes
        for category, nbytes in (self._peak_transient or {}).items():
            totals[category] += nbytes
        return totals

    def _category(self, record: _Storage) -> str:
        label = self._labels.get(record.rid)
        if label is not None:
            return label
        return "activations" if record.phase == "forward" else "temporaries"


@contextmanager
def attributed_to(phase: str) -> Iterator[None]:
    """Attribute storages created inside the block to `phase` in every tracker entered on this
    thread: for code that holds no tracker (the trainer's step). No tracker: no effect."""
    trackers = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, MemoryTracker)]
    with ExitStack() as stack:
        for tracker in trackers:
            stack.enter_context(tracker.phase(phase))
        yield


_RESIZE_WATCHERS: list[MemoryTracker] = []
"""The trackers entered now (any thread), each told of every in-place storage resize."""

_unwatched_resize = torch.UntypedStorage.resize_


def _resize_and_tell(storage: torch.UntypedStorage, size: int) -> Any:
    resized = _unwatched_resize(storage, size)
    for tracker in tuple(_RESIZE_WATCHERS):
        tracker._storage_resized(storage)
    return resized


def _watch_resizes() -> None:
    """Route `UntypedStorage.resize_` through the entered trackers (installed once; a resize
    with no tracker entered costs one empty loop)."""
    if torch.UntypedStorage.resize_ is not _resize_and_tell:
        torch.UntypedStorage.resize_ = _resize_and_tell  # type: ignore[method-assign, assignment]


def _plain_tensors(leaves: list[Any]) -> Iterator[Any]:
    """`leaves` with each wrapper tensor (DTensor) replaced by the tensors it holds.

    A wrapper's own storage is a placeholder of the global shape that holds no memory (an FSDP2
    parameter sharded over 4 ranks would count 4 times its shard); what it wraps is counted.
    """
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and is_traceable_wrapper_subclass(leaf):
            names, _ = leaf.__tensor_flatten__()
            yield from _plain_tensors([getattr(leaf, name) for name in names])
        else:
            yield leaf


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    ]
