"""Plan ahead: lease and plan the next trial while this one trains.

Choosing a plan costs CPU time (the predictor traces the training step: tenths of a second to
seconds a configuration), and on a GPU worker that time is the card idling between two trials:
on the tuning-efficiency benchmark it was half of vramtune's card time (bench/results/
tuning_efficiency.md). With `--plan-ahead` a background thread, started when a trial begins to
train, leases the next trial and chooses its plan for the card as it will be when this trial
ends (the free bytes measured before it started), so the next run starts as soon as this one
ends. The prices, named: the sampler proposes the next trial one result earlier (as it would
with one more worker), the next trial's lease is held (heartbeated) while it waits, and the host
CPU plans while it feeds the card (on a CPU-only worker the two share the cores).

A trial prepared here is the main thread's from `take()`: it reports, hands back or fails it
there. When the worker stops with a prepared trial, `release` gives it back (failed
'interrupted': the server re-offers it, no attempt counted).

Hand-backs in the background (`settle`): a trial whose choice is a hand-back never runs on this
card, so there is nothing for the main thread to wait for. Given `settle`, the thread hands it
back itself (settle returns True) and leases and plans the next trial, again and again while
the current trial trains, so the plan after a hand-back is off the card's time too. It stops
leasing once `take()` is called (the current trial ended: the choice in progress is finished and
handed over, never another one begun) or `keep_going()` says no (the worker stops, or reached
its trial cap).

Leasing late (`lease_delay`): a trial leased ahead is this card's until the current run ends,
however long that is, while another card may free up first and would have run it at once. On
the tuning-efficiency benchmark a trial leased at the start of a 5.7 s resized run (digits,
seed 7) was the one that reached the best metric, and waited the whole run behind it. So when
the fleet's step-time model predicts the current run, `begin` waits until the planning is
predicted to just fit before the run ends (with margins for both predictions' errors) and
leases then; `take()` during that wait (the run ended early) cancels the lease ahead, and the
main thread leases itself as without --plan-ahead. Without a prediction it leases at once.
The agent does not pass a delay yet: on the benchmark (the vramtune-lease-late arm) it moved
the time to naive's best by a few points either way, inside the seeds' spread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from vramtune.service.wire import Assignment

Chosen = TypeVar("Chosen")

RUN_SHARE = 0.6
"""Of the current run's predicted seconds, the part counted on before leasing ahead: the
step-time model's p90 error is 32-42 % (bench/results/tuning_efficiency.md), and it predicts
the training steps only (evaluation comes on top), so the run rarely ends before this."""
PLANNING_LEAD = 2.0
"""Planning is begun this many times the card's longest recent plan choice before that point."""


def lease_delay(predicted_run_s: float | None, planning_s: float) -> float:
    """Seconds after the current run starts to lease and plan the next trial: 0 (at once)
    without a prediction, else so that a plan choice of `planning_s` (the card's longest
    recent one) ends, with a margin, before the run's predicted end (see the module docstring).
    """
    if predicted_run_s is None or predicted_run_s <= 0:
        return 0.0
    return max(0.0, RUN_SHARE * predicted_run_s - PLANNING_LEAD * planning_s)


@dataclass(frozen=True)
class Prepared(Generic[Chosen]):
    """A trial leased ahead and its plan choice; `chosen` None when it must be chosen again
    on the main thread (the choice raised: the main thread fails the trial with the message)."""

    assignment: Assignment
    chosen: Chosen | None


class PlanAhead(Generic[Chosen]):
    """At most one trial leased and planned in the background (see the module docstring)."""

    def __init__(
        self,
        lease: Callable[[int], Assignment | None],
        choose: Callable[[Assignment, int], Chosen | None],
        failed: Callable[[Exception], None],
        settle: Callable[[Prepared[Chosen]], bool] | None = None,
        keep_going: Callable[[], bool] = lambda: True,
    ) -> None:
        self._lease, self._choose, self._failed = lease, choose, failed
        self._settle, self._keep_going = settle, keep_going
        self._thread: threading.Thread | None = None
        self._result: Prepared[Chosen] | None = None
        self._taking = threading.Event()  # the main thread wants the result: lease no more
        self.settled = 0  # trials seen to their end in the background (handed back)

    def begin(self, free_bytes: int, delay_s: float = 0.0) -> None:
        """Lease and plan the next trial in the background for a card with `free_bytes` free,
        `delay_s` from now (lease_delay) unless `take()` comes first."""
        if self._thread is not None:
            return  # one ahead at most: the one prepared is not taken yet
        self._taking.clear()
        self._thread = threading.Thread(
            target=self._prepare, args=(free_bytes, delay_s), name="plan-ahead", daemon=True
        )
        self._thread.start()

    def take(self) -> Prepared[Chosen] | None:
        """The trial prepared in the background (waiting for its choice), or None."""
        if self._thread is None:
            return None
        self._taking.set()
        self._thread.join()
        prepared, self._thread, self._result = self._result, None, None
        return prepared

    def release(self, give_back: Callable[[Assignment], None]) -> None:
        """Give back a prepared trial nobody will run (the worker stops)."""
        prepared = self.take()
        if prepared is not None:
            give_back(prepared.assignment)

    def _prepare(self, free_bytes: int, delay_s: float = 0.0) -> None:
        if delay_s > 0 and self._taking.wait(delay_s):
            return  # the run ended before the lease was due: the main thread leases
        while True:
            prepared = self._prepare_one(free_bytes)
            if prepared is None or self._settle is None:
                self._result = prepared
                return
            try:
                settled = self._settle(prepared)
            except Exception as error:  # settle owns the trial's calls; stop planning ahead
                self._failed(error)
                return
            if not settled:  # it runs here: the main thread's, when the card is free
                self._result = prepared
                return
            self.settled += 1
            if self._taking.is_set() or not self._keep_going():
                return  # the card is free again (or the worker stops): the main thread leases

    def _prepare_one(self, free_bytes: int) -> Prepared[Chosen] | None:
        try:
            assignment = self._lease(free_bytes)
        except Exception as error:  # the main thread leases again itself
            self._failed(error)
            return None
        if assignment is None:
            return None
        try:
            chosen = self._choose(assignment, free_bytes)
        except Exception as error:  # chosen again, and failed there, by the main thread
            self._failed(error)
            chosen = None
        return Prepared(assignment, chosen)
