"""Replaying a traced loop's repeated calls (vramtune/worker/predictor/repeats.py): a replay
counts what running the call counts, to the byte, and a call that is not clean is never
replayed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vramtune.worker.device.memory import EVALUATION_PHASE, MemoryTracker
from vramtune.worker.predictor import repeats
from vramtune.worker.predictor.repeats import RepeatedCalls, replayed
from vramtune.worker.trial.repeated import repeated


@contextmanager
def _traced() -> Iterator[MemoryTracker]:
    tracker = MemoryTracker()
    with FakeTensorMode(), tracker:
        yield tracker


def _step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward of sorts: temporaries larger than what it returns, and its input back."""
    hidden = torch.relu(x @ torch.ones(x.shape[-1], 300))
    logits = hidden @ torch.ones(300, 7)
    return logits.detach(), x


def _loop(step: Callable[..., Any], sizes: list[int]) -> list[torch.Tensor]:
    """An evaluation loop: each batch's outputs gathered, the gathered tensor growing."""
    gathered = None
    kept = []
    for size in sizes:
        logits, passed = step(torch.empty(size, 5))
        gathered = logits if gathered is None else torch.cat((gathered, logits))
        kept.append(passed)
    assert gathered is not None
    return [gathered, *kept]


def _counted(tracker: MemoryTracker) -> tuple[int, dict[str, int], dict[str, int], int]:
    return tracker.peak_bytes, dict(tracker.phase_peaks), tracker.breakdown(), tracker.live_bytes


@pytest.mark.parametrize("phase", [None, EVALUATION_PHASE])
def test_a_replayed_call_counts_what_running_it_counts(
    phase: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = [8] * 9 + [3]  # a last, partial batch too

    def run(replay: bool) -> tuple[Any, ...]:
        monkeypatch.setattr(repeats, "REPLAY_AFTER", 2 if replay else 10**9)
        with _traced() as tracker:
            step = RepeatedCalls(_step, tracker, lambda: tracker.current_phase())
            with tracker.phase(phase) if phase else nullcontext():
                kept = _loop(step, sizes)
            counted = _counted(tracker)
        del kept
        return counted, step.run, step.replayed

    replayed, run_calls, replays = run(replay=True)
    full, all_calls, none = run(replay=False)
    assert (run_calls, replays) == (3, 7)  # two alike, then replays; the partial batch runs
    assert (all_calls, none) == (10, 0)
    assert replayed == full


def test_a_call_that_keeps_what_it_makes_is_never_replayed() -> None:
    kept: list[torch.Tensor] = []

    def keeping(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kept.append(torch.empty(100))  # a cache: the next call holds more
        return _step(x)

    with _traced() as tracker:
        step = RepeatedCalls(keeping, tracker, lambda: None)
        _loop(step, [4] * 6)
    assert (step.run, step.replayed) == (6, 0)


def test_a_call_that_frees_what_was_there_before_it_is_never_replayed() -> None:
    held = {"state": None}

    def swapping(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        held["state"] = torch.empty(100)  # drops the last call's: its bytes cannot be told
        return _step(x)

    with _traced() as tracker:
        step = RepeatedCalls(swapping, tracker, lambda: None)
        _loop(step, [4] * 6)
    assert step.replayed == 0


def test_a_changed_context_runs_the_call_again() -> None:
    with _traced() as tracker:
        mode = {"now": "a"}
        step = RepeatedCalls(_step, tracker, lambda: mode["now"])
        _loop(step, [4] * 4)
        mode["now"] = "b"
        _loop(step, [4] * 4)
    assert (step.run, step.replayed) == (4, 4)


def test_a_replayed_transient_is_counted_inside_an_outer_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The evaluation as a whole is counted as a block (its excess stands in for it in other
    # traces) while its steps are replayed inside it.
    def run(replay: bool) -> tuple[int, Any]:
        monkeypatch.setattr(repeats, "REPLAY_AFTER", 2 if replay else 10**9)
        with _traced() as tracker:
            base = torch.empty(1000)
            step = RepeatedCalls(_step, tracker, lambda: None)
            with tracker.counting_block() as block:
                kept = _loop(step, [6] * 5)
            del kept, base
        return step.replayed, block.excess()

    replayed, fast = run(replay=True)
    none, full = run(replay=False)
    assert (replayed, none) == (3, 0)
    assert fast == full


def _chunked(hidden: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
    """A loss summed over chunks of the rows, each chunk's call marked repeated (as the chunked
    cross-entropy marks its own); the targets are real, as held-out data is."""
    total = torch.zeros(())
    for part, part_targets in zip(hidden.chunk(chunks), targets.chunk(chunks), strict=True):
        total = total + repeated(_summed)(part, part_targets)
    return total


def _summed(part: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = part @ torch.ones(part.shape[-1], 50)
    return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")


@pytest.mark.parametrize("replay", [True, False])
def test_marked_calls_replay_in_a_trace_and_run_as_they_are_outside_one(replay: bool) -> None:
    targets = torch.zeros(64, dtype=torch.long)  # real, made outside the trace

    def evaluate(tracker: MemoryTracker) -> tuple[int, dict[str, int]]:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake, tracker:
            hidden = torch.empty(64, 16)
            with tracker.paused():  # the evaluation's warm-up: nothing counted
                _chunked(hidden, targets, 16)
            with tracker.phase(EVALUATION_PHASE):
                _chunked(hidden, targets, 16)
        return tracker.peak_bytes, dict(tracker.phase_peaks)

    tracker = MemoryTracker()
    with replayed(tracker) if replay else nullcontext({}) as calls:
        counted = evaluate(tracker)
    assert counted == evaluate(MemoryTracker())  # no replay: every chunk run
    if replay:  # two alike run, uncounted and counted each, the other 14 replayed
        assert (calls[_summed].run, calls[_summed].replayed) == (4, 28)
    assert repeated(_summed) is _summed  # outside `replayed`: the call itself
