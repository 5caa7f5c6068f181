"""Calls a task's loop repeats with the same shapes, which a prediction may replay (issue 44).

Task code marks such a call: `repeated(call)(*args)`. A real run calls `call` as it is. Inside
the predictor's CPU trace of an evaluation (`vramtune.worker.predictor.repeats.replayed`), the
call goes through a `RepeatedCalls` instead, which runs the first calls and replays the rest
from what they allocated: the chunked cross-entropy's hundreds of identical chunks per batch
(`vramtune.worker.tasks.hf`) cost a trace three of them.

Marking a call says its allocations follow from its arguments' shapes, not their values (the
held-out targets an evaluation passes are real tensors, described by their shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

Call = TypeVar("Call", bound=Callable[..., Any])
Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]

_replaying: ContextVar[Wrap | None] = ContextVar("vramtune_replaying", default=None)


def repeated(call: Call) -> Call:
    """`call` itself, or the trace's replaying stand-in for it while one is set."""
    wrap = _replaying.get()
    return call if wrap is None else wrap(call)  # type: ignore[return-value]


@contextmanager
def replaying(wrap: Wrap) -> Iterator[None]:
    """Inside the block, `repeated(call)` is `wrap(call)` (in this thread or task only)."""
    token = _replaying.set(wrap)
    try:
        yield
    finally:
        _replaying.reset(token)
