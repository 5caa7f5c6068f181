"""Slot accounting for a card that runs several trials at once (packing).

A packing worker (``--max-trials-per-card N``, N > 1) keeps a `SlotBook`: which trials run on
its card now and how many bytes each has reserved. A trial's reservation is its predicted peak
(calibrated, so the calibration margin is in it) grown by the study's safety margin, the same
headroom the trial has when it runs alone (`reservation_bytes`); its process is limited to
exactly that (worker/run/slot_process.py), so a trial whose prediction was wrong runs out of its own
memory and not its neighbours'.

The worker asks the server for more work while the book has a free slot and memory left,
stating as its free memory what the running trials have not reserved (`SlotBook.available`):
the server learns what this card can still give, and no trial is handed back because of its
neighbours, since a plan is always chosen against the whole card (`SlotBook.capacity`). A
trial that does not fit what is left waits, its lease renewed, until its neighbours end. A
trial that may not be packed (the study did not allow it, or it ran out of memory on this card
model before) runs `exclusive`: alone, with the whole card, and nothing starts beside it.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

Hold = TypeVar("Hold")

MAX_TRIALS_PER_CARD_CAP = 4
"""The default number of trials a card runs at once is at most this (and at most the cores)."""


def default_max_trials_per_card(cpu_count: int | None = None) -> int:
    """min(4, CPU cores): each packed trial's process needs a core to feed its card or compute.

    Packing is on by default on the worker's side; a study still has to allow it
    (``memory_policy.allow_packing``), so a study that did not ask keeps one trial per card.
    """
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(MAX_TRIALS_PER_CARD_CAP, cores))


def threads_per_trial(slots: int, cpu_count: int | None = None) -> int:
    """Torch threads for each packed trial's process: the cores shared out, at least one.

    Without this, every process starts as many threads as there are cores, and N trials
    oversubscribe the CPU N times over (measured: bench/results/packing.md).
    """
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, cores // max(1, slots))


def reservation_bytes(predicted_peak: int, margin: float) -> int:
    """The bytes a packed trial holds: its predicted peak grown by the policy's margin.

    Alone, a plan is chosen so that peak <= free * (1 - margin): dividing by (1 - margin) keeps
    that headroom for the trial when it shares the card.
    """
    keep = 1.0 - min(max(margin, 0.0), 0.9)
    return math.ceil(round(predicted_peak / keep, 6))  # 1 - 0.9 is 0.0999...: no extra byte


def cuda_memory_fraction(limit_bytes: int, context_bytes: int, total_bytes: int) -> float:
    """What `torch.cuda.set_per_process_memory_fraction` is given for a trial's process.

    The fraction caps the caching allocator of the process; the CUDA context is outside the
    allocator but inside the prediction (the card constants), hence taken off the limit.
    """
    if total_bytes <= 0:
        raise ValueError(f"a card has a positive size, got {total_bytes}")
    allocator_bytes = max(limit_bytes - context_bytes, 0)
    return min(max(allocator_bytes / total_bytes, 0.0), 1.0)


@dataclass(frozen=True)
class Reservation:
    """One trial's hold on the card."""

    trial_id: int
    nbytes: int
    exclusive: bool


class TrialBook(Generic[Hold]):
    """What a worker's running trials hold (a card's bytes, a node's cards); thread-safe, with
    waits. `SlotBook` and worker.run.cards.`CardBook` keep the same books of different holds.

    `capacity` is what a card gives this worker with no trial of it running (its free bytes
    when idle); the worker refreshes it whenever the book is empty.
    """

    def __init__(self, max_trials: int, capacity: int) -> None:
        self.max_trials = max_trials
        self._capacity = capacity
        self._held: dict[int, Hold] = {}
        self._waiting = 0  # trials leased and waiting for room: no new ask meanwhile
        self._changed = threading.Condition()

    @property
    def capacity(self) -> int:
        """The bytes a card gives this worker when no trial runs."""
        with self._changed:
            return self._capacity

    def refresh_capacity(self, free_bytes: int) -> None:
        """A new reading of the card's free bytes counts only while nothing of ours runs."""
        with self._changed:
            if not self._held:
                self._capacity = free_bytes

    def running(self) -> int:
        """How many trials hold something now."""
        with self._changed:
            return len(self._held)

    def release(self, trial_id: int) -> None:
        """The trial's run is over: what it held is free again."""
        with self._changed:
            self._held.pop(trial_id, None)
            self._changed.notify_all()

    def wait_for_change(self, timeout_s: float) -> None:
        """Sleep until a trial releases what it held, or `timeout_s`."""
        with self._changed:
            self._changed.wait(timeout_s)

    def _wait_to_hold(
        self,
        ready: Callable[[], bool],
        hold: Callable[[], Hold],
        stop: threading.Event,
        poll_s: float,
    ) -> Hold | None:
        """`hold()` as soon as `ready()`, under the lock; None if `stop` is set first. Until
        then no new trial is asked for (the books' `can_ask` see `_waiting`)."""
        with self._changed:
            self._waiting += 1
            try:
                while not ready():
                    if stop.is_set():
                        return None
                    self._changed.wait(poll_s)  # woken by release; stop is polled
                return hold()
            finally:
                self._waiting -= 1


class SlotBook(TrialBook[Reservation]):
    """Trials running on one card and their reservations."""

    def __init__(self, max_trials: int, capacity: int) -> None:
        if max_trials < 1:
            raise ValueError(f"a card runs at least one trial at once, got {max_trials}")
        super().__init__(max_trials, capacity)

    def reserved(self) -> int:
        """Bytes the running trials hold."""
        with self._changed:
            return self._reserved()

    def available(self, free_now: int | None = None) -> int:
        """What a new trial could get: the capacity less the reservations (and never more than
        the card's free bytes now, `free_now`, which other processes may have taken)."""
        with self._changed:
            left = max(self._capacity - self._reserved(), 0)
        return left if free_now is None else min(left, max(free_now, 0))

    def can_ask(self) -> bool:
        """Whether to ask the server for another trial: a free slot, memory left, no trial
        waiting for room, and no exclusive trial running."""
        with self._changed:
            return (
                len(self._held) < self.max_trials
                and self._waiting == 0
                and not self._exclusive_held()
                and self._capacity - self._reserved() > 0
            )

    def fits(self, nbytes: int, exclusive: bool) -> bool:
        """Whether a trial needing `nbytes` could start now (exclusive: alone on the card)."""
        with self._changed:
            return self._fits(nbytes, exclusive)

    def reserve(self, trial_id: int, nbytes: int, exclusive: bool) -> Reservation:
        """Hold `nbytes` for the trial; raises ValueError if it does not fit now."""
        with self._changed:
            if trial_id in self._held:
                raise ValueError(f"trial {trial_id} holds a slot already")
            if not self._fits(nbytes, exclusive):
                raise ValueError(f"trial {trial_id} does not fit: {nbytes} bytes, {self._state()}")
            return self._hold(Reservation(trial_id, nbytes, exclusive))

    def wait_to_reserve(
        self, trial_id: int, nbytes: int, exclusive: bool, stop: threading.Event, poll_s: float
    ) -> Reservation | None:
        """Reserve as soon as the trial fits; None if `stop` is set first. Until then no new
        trial is asked for (`can_ask` is False)."""
        return self._wait_to_hold(
            lambda: self._fits(nbytes, exclusive),
            lambda: self._hold(Reservation(trial_id, nbytes, exclusive)),
            stop,
            poll_s,
        )

    def _fits(self, nbytes: int, exclusive: bool) -> bool:
        if exclusive:
            return not self._held
        return (
            len(self._held) < self.max_trials
            and not self._exclusive_held()
            and self._reserved() + nbytes <= self._capacity
        )

    def _hold(self, reservation: Reservation) -> Reservation:
        self._held[reservation.trial_id] = reservation
        return reservation

    def _exclusive_held(self) -> bool:
        return any(r.exclusive for r in self._held.values())

    def _reserved(self) -> int:
        return sum(r.nbytes for r in self._held.values())

    def _state(self) -> str:
        return (
            f"{len(self._held)}/{self.max_trials} slots, {self._reserved()} of "
            f"{self._capacity} bytes reserved"
        )
