"""The packing loop: several trials at once on one card, each in its own process.

With ``--max-trials-per-card N`` (N > 1) the agent (worker/loop/agent.py) runs this loop instead of
one trial at a time. While its `SlotBook` (worker/run/slots.py) has a free slot and memory left, it
asks the server for a trial, stating as its free memory what its running trials have not
reserved; the server's dispatch needs no change for that. Each trial's plan is chosen against
the whole card, as if it ran alone, so packing never resizes a trial or hands it back; then:

- a trial of a study that allows packing (``memory_policy.allow_packing``), with a prediction,
  reserves its predicted peak grown by the study's margin and runs in a slot process limited to
  that reservation (worker/run/slot_process.py), beside the others, once it fits what is left
  (until then it waits, its lease renewed by the heartbeats);
- any other trial runs exclusive: it waits for the card to empty, runs alone with the whole
  card in the agent's own process (exactly as without packing), and nothing starts beside it.
  A trial that ran out of memory on this card model before (`Assignment.plans_tried`) is one:
  its prediction was wrong, so its retry runs alone, and one OOM stays one OOM.

Each trial is seen to its end on a thread of its own (the REST calls, and in a packed trial the
round trips with its process); the heartbeat thread renews every held lease. That part, the
loop that asks while there is room, and the pool of trial processes are `TrialThreads`, which
the node worker's loop (vramtune/worker/loop/node.py: trials side by side on disjoint cards) shares.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from vramtune.common.memory import peak_of
from vramtune.service.wire import Assignment, Plan, PlanChoice, TrainBudget
from vramtune.worker.loop import outcomes
from vramtune.worker.loop.cycle import TrialCycle
from vramtune.worker.plan.policy import HandBack, RunAsPlanned
from vramtune.worker.run.slot_process import Given, SlotProcess
from vramtune.worker.run.slots import Reservation, SlotBook, reservation_bytes, threads_per_trial
from vramtune.worker.trial.runner import CardSpec, Config, Reporter, RunResult, TrialRunner


@dataclass
class _InSlot:
    """A packed trial's runner: its slot process, under its reservation (a `RunsTrials`)."""

    slot: SlotProcess
    task: str
    limit_bytes: int
    ended: Callable[[], None]  # gives the process and the reservation back

    def run(
        self, config: Config, plan: Plan, budget: TrainBudget, card: CardSpec, reporter: Reporter
    ) -> RunResult:
        """Train in the slot process, limited to the reservation; the slot is free again as
        soon as the run ends (the next trial need not wait for this one's final call)."""
        try:
            return self.slot.run(self.task, config, plan, budget, card, self.limit_bytes, reporter)
        finally:
            self.ended()


@dataclass(frozen=True)
class Placed:
    """A trial with its plan chosen, ready to start once its reservation is granted."""

    assignment: Assignment
    runner: TrialRunner
    config: dict[str, Any]
    decision: RunAsPlanned
    choice: PlanChoice
    how: dict[str, Any]


class Book(Protocol):
    """What the loop asks of its accounting: a `SlotBook` (one card) or a `CardBook` (a node)."""

    max_trials: int  # trials at once: trial processes are started for as many

    def refresh_capacity(self, free_bytes: int) -> None: ...

    def can_ask(self) -> bool: ...

    def running(self) -> int: ...

    def release(self, trial_id: int) -> None: ...

    def wait_for_change(self, timeout_s: float) -> None: ...


B = TypeVar("B", bound=Book)
H = TypeVar("H")  # what a placed trial holds: a `Reservation`, or a node's `CardGrant`


class TrialThreads(Generic[B, H]):
    """Asks for trials while its book has room, and sees each to its end on its own thread.

    A subclass places a leased trial (`_place`: choose its plan, wait for room, `_start_thread`)
    and runs it (`_start_and_run`); the trial's hold on the book ends when its thread does.
    """

    def __init__(self, agent: TrialCycle, book: B, prestarted: int) -> None:
        self.agent = agent
        self.book = book
        self.prestarted = prestarted  # trial processes started with the loop
        self.source = agent.options.runner_source or Given(dict(agent.runners))
        self.threads = threads_per_trial(book.max_trials)
        self._idle_slots: list[SlotProcess] = []
        self._all_slots: list[SlotProcess] = []
        self._slots_lock = threading.Lock()
        self._runs: list[threading.Thread] = []
        self._error: BaseException | None = None  # a trial thread's unexpected error

    # ------------------------------------------------------------ the loop

    def run(self) -> None:
        """Ask, place and run trials until stopped, the trial cap, or idle too long."""
        self.agent.offered_bytes = self.offered_bytes
        try:
            self._start_slots()
            self._loop()
        except BaseException:
            self.agent.stop.set()  # running trials end as interrupted and are offered again
            raise
        finally:
            for thread in self._runs:
                thread.join()
            self._close_slots()
            self.agent.offered_bytes = self.agent.free_bytes
        if self._error is not None:
            raise self._error

    def _loop(self) -> None:
        agent = self.agent
        idle_since = _now()
        while not agent.stop.is_set() and not agent.reached_max_trials() and self._error is None:
            self._reap()
            self.book.refresh_capacity(agent.free_bytes())
            if not self.book.can_ask():
                self.book.wait_for_change(agent.options.idle_poll_s)
                idle_since = _now()
                continue
            leased = self.ask()
            if leased or self.book.running():
                idle_since = _now()
            if leased:
                continue
            if agent.idle_too_long(idle_since):
                agent.event("idle_exit", idle_s=round(_now() - idle_since, 1))
                return
            agent.stop.wait(agent.options.idle_poll_s)

    def offered_bytes(self) -> int:
        """What a new trial could get (the free memory the server is told)."""
        raise NotImplementedError

    def offered_cards(self) -> int | None:
        """The free cards the server is told (None: a one-card worker states none)."""
        return None

    def ask(self) -> bool:
        """Ask for one trial and place it; False when the server had no work."""
        agent = self.agent
        assignment = agent.lease(self.offered_bytes(), self.offered_cards())
        if assignment is None:
            return False
        handed_over = False
        try:
            handed_over = bool(agent.guarded(assignment, lambda: self._place(assignment)))
        finally:
            if not handed_over:  # else the trial's thread releases it
                agent.heartbeats.release(assignment.trial_id)
        return True

    # ------------------------------------------------------------ one trial

    def _place(self, assignment: Assignment) -> bool:
        """Choose the plan, wait for room, start the trial's thread (`_start_thread`); True
        once that thread owns the trial (it then releases the lease)."""
        raise NotImplementedError

    def _start_and_run(self, placed: Placed, held: H) -> None:
        """Tell the server the trial starts, run it, deliver its final call (its thread)."""
        raise NotImplementedError

    def _start_thread(self, placed: Placed, held: H) -> None:
        thread = threading.Thread(
            target=self._run, args=(placed, held), name=f"trial-{placed.assignment.trial_id}"
        )
        self._runs.append(thread)
        thread.start()

    def _run(self, placed: Placed, held: H) -> None:
        agent, assignment = self.agent, placed.assignment
        try:
            agent.guarded(assignment, lambda: self._start_and_run(placed, held))
        except BaseException as error:  # ServerUnavailable at shutdown, or a bug: the loop ends
            agent.event("trial_thread_failed", assignment, error=repr(error))
            self._error = self._error or error
        finally:
            self.book.release(assignment.trial_id)
            agent.heartbeats.release(assignment.trial_id)

    # ------------------------------------------------------------ slot processes

    def _start_slots(self) -> None:
        """Start `prestarted` slot processes now, as the worker loads its tasks at start: torch
        is imported by then, not in the first packed trials' time (they start side by side)."""
        with self._slots_lock:
            for _ in range(self.prestarted - len(self._all_slots)):
                slot = SlotProcess(self.source, self.threads)
                self._all_slots.append(slot)
                self._idle_slots.append(slot)
            tasks = [slot.wait_ready() for slot in self._all_slots]
        self.agent.event(
            "slots_ready", slots=len(tasks), threads_per_trial=self.threads, tasks=tasks[0]
        )

    def _take_slot(self) -> SlotProcess:
        """An idle slot process, or a new one (started once, reused trial after trial)."""
        with self._slots_lock:
            while self._idle_slots:
                slot = self._idle_slots.pop()
                if slot.alive:
                    return slot
            slot = SlotProcess(self.source, self.threads)
            self._all_slots.append(slot)
            return slot

    def _give_slot(self, slot: SlotProcess) -> None:
        with self._slots_lock:
            if slot.alive:
                self._idle_slots.append(slot)

    def _close_slots(self) -> None:
        with self._slots_lock:
            slots, self._all_slots, self._idle_slots = self._all_slots, [], []
        for slot in slots:
            slot.close()

    def _reap(self) -> None:
        """Forget the threads of trials that ended."""
        self._runs = [thread for thread in self._runs if thread.is_alive()]


class Packer(TrialThreads[SlotBook, Reservation]):
    """Runs one agent's trials several at a time on its card (see the module's docstring)."""

    def __init__(self, agent: TrialCycle) -> None:
        slots = agent.options.max_trials_per_card
        super().__init__(agent, SlotBook(slots, agent.free_bytes()), prestarted=slots)

    def offered_bytes(self) -> int:
        """What the card can still give a new trial (the free memory the server is told)."""
        return self.book.available(self.agent.free_bytes())

    # ------------------------------------------------------------ one trial

    def _place(self, assignment: Assignment) -> bool:
        """Choose the plan, wait for room, start the trial's thread; True once it owns the
        trial (the thread then releases its lease)."""
        agent = self.agent
        found = agent.runner_for(assignment)
        if found is None:
            return False
        runner, config = found
        capacity = self.book.capacity
        chosen = agent.choose(assignment, runner, config, capacity)  # as if alone on the card
        if chosen is None:
            return False
        decision, choice, how = chosen
        if isinstance(decision, HandBack):
            agent.hand_back(assignment, decision, choice, how)
            return False
        need, exclusive = self.hold_for(assignment, decision, capacity)
        reservation = self.book.wait_to_reserve(
            assignment.trial_id, need, exclusive, agent.stop, agent.options.idle_poll_s
        )
        if reservation is None:  # stopping before it could start: offered again, not failed
            message = "the worker stopped before the trial could start"
            agent.finish(assignment, outcomes.failed(assignment, "interrupted", message))
            return False
        self._start_thread(Placed(assignment, runner, config, decision, choice, how), reservation)
        return True

    def hold_for(
        self, assignment: Assignment, decision: RunAsPlanned, capacity: int
    ) -> tuple[int, bool]:
        """The bytes the trial reserves and whether it runs exclusive (alone on the card)."""
        policy = assignment.memory_policy
        packable = (
            policy.allow_packing
            and not assignment.plans_tried  # ran out of memory here before: retried alone
            and decision.prediction.method != "none"  # nothing to reserve by
        )
        need = reservation_bytes(peak_of(decision.prediction), policy.margin)
        if not packable or need > capacity:
            return capacity, True
        return need, False

    def _start_and_run(self, placed: Placed, reservation: Reservation) -> None:
        agent, assignment, decision = self.agent, placed.assignment, placed.decision
        agent.started(
            assignment,
            decision,
            placed.choice,
            placed.how,
            packed=not reservation.exclusive,
            reserved_bytes=reservation.nbytes,
            beside=self.book.running() - 1,
        )
        if not reservation.exclusive:
            self._run_in_slot(placed, reservation)
            return
        agent.run_planned(
            assignment,
            placed.runner,
            placed.config,
            decision.plan,
            decision.prediction,
            decision.step_time,
        )

    def _run_in_slot(self, placed: Placed, reservation: Reservation) -> None:
        slot = self._take_slot()
        given_back = threading.Event()

        def ended() -> None:  # once: the process back to the pool first, then the slot
            if not given_back.is_set():
                given_back.set()
                self._give_slot(slot)
                self.book.release(reservation.trial_id)
                self.agent.event("slot_freed", placed.assignment, running=self.book.running())

        try:
            self.agent.run_planned(
                placed.assignment,
                _InSlot(slot, placed.assignment.task, reservation.nbytes, ended),
                placed.config,
                placed.decision.plan,
                placed.decision.prediction,
                placed.decision.step_time,
                alone=False,
            )
        finally:
            ended()


def _now() -> float:
    return time.monotonic()
