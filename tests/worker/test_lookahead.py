"""vramtune.worker.loop.lookahead: hand-backs settled in the background while the current trial
trains.

Real threads, fake server calls: a trial whose choice is a hand-back is handed back by the
background thread itself, which leases and plans the next one, so the main thread (the card)
never plans after a hand-back while a trial trains. Waits are on events; the timeouts only keep
a broken build from hanging the suite.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime

from vramtune.service.wire import Assignment, MemoryPolicy, TrainBudget
from vramtune.worker.loop.lookahead import PlanAhead, Prepared, lease_delay

WAIT_S = 30.0


def assignment(trial_id: int) -> Assignment:
    return Assignment(
        trial_id=trial_id,
        number=trial_id,
        attempt=0,
        lease=f"lease-{trial_id}",
        lease_expires_at=datetime.now(UTC),
        study="s",
        task="quadratic",
        params={},
        task_config={},
        budget=TrainBudget(max_steps=1),
        memory_policy=MemoryPolicy(),
        n_objectives=1,
    )


class FakeServer:
    """Trials 1, 2, ... on lease; the choice for the ids in `hand_back` is a hand-back."""

    def __init__(self, hand_back: set[int]) -> None:
        self.hand_back = hand_back
        self.leased: list[tuple[int, int]] = []  # (trial id, free bytes stated)
        self.handed_back: list[int] = []
        self.errors: list[str] = []
        self.runnable_planned = threading.Event()

    def lease(self, free_bytes: int) -> Assignment | None:
        trial_id = len(self.leased) + 1
        self.leased.append((trial_id, free_bytes))
        return assignment(trial_id)

    def choose(self, leased: Assignment, free_bytes: int) -> str:
        if leased.trial_id in self.hand_back:
            return "hand back"
        self.runnable_planned.set()
        return "run as planned"

    def settle(self, prepared: Prepared[str]) -> bool:
        if prepared.chosen != "hand back":
            return False
        self.handed_back.append(prepared.assignment.trial_id)
        return True

    def failed(self, error: Exception) -> None:
        self.errors.append(str(error))


def test_hand_backs_are_settled_in_the_background_and_the_next_trial_planned() -> None:
    server = FakeServer(hand_back={1, 2})
    ahead = PlanAhead(server.lease, server.choose, server.failed, settle=server.settle)
    ahead.begin(free_bytes=1000)
    # the current trial still trains: the thread hands 1 and 2 back and plans 3
    assert server.runnable_planned.wait(WAIT_S)
    prepared = ahead.take()
    assert prepared is not None
    assert prepared.assignment.trial_id == 3
    assert prepared.chosen == "run as planned"
    assert server.handed_back == [1, 2]
    assert ahead.settled == 2
    # every lease stated the card as the running trial found it
    assert server.leased == [(1, 1000), (2, 1000), (3, 1000)]
    assert server.errors == []


def test_taking_stops_the_background_after_the_choice_in_progress() -> None:
    server = FakeServer(hand_back={1, 2, 3})
    wanted = threading.Event()
    settle = server.settle

    def settle_when_the_card_is_free(prepared: Prepared[str]) -> bool:
        # the current trial ends while trial 1's hand-back is on its way
        wanted.set()
        assert ahead._taking.wait(WAIT_S)
        return settle(prepared)

    ahead = PlanAhead(server.lease, server.choose, server.failed, settle_when_the_card_is_free)
    ahead.begin(free_bytes=1000)
    assert wanted.wait(WAIT_S)
    assert ahead.take() is None  # trial 1 handed back, no other leased: the main thread leases
    assert server.handed_back == [1]
    assert [trial for trial, _ in server.leased] == [1]


def test_keep_going_false_stops_after_a_hand_back() -> None:
    server = FakeServer(hand_back={1, 2})
    ahead = PlanAhead(
        server.lease, server.choose, server.failed, settle=server.settle, keep_going=lambda: False
    )
    ahead.begin(free_bytes=1000)
    assert ahead.take() is None
    assert server.handed_back == [1]
    assert len(server.leased) == 1


def test_without_settle_a_hand_back_is_the_main_threads() -> None:
    server = FakeServer(hand_back={1})
    ahead: PlanAhead[str] = PlanAhead(server.lease, server.choose, server.failed)
    ahead.begin(free_bytes=1000)
    prepared = ahead.take()
    assert prepared is not None
    assert (prepared.assignment.trial_id, prepared.chosen) == (1, "hand back")
    assert server.handed_back == []


def test_a_settle_that_raises_is_reported_and_planning_ahead_stops() -> None:
    server = FakeServer(hand_back={1, 2})

    def broken(prepared: Prepared[str]) -> bool:
        raise RuntimeError("server unreachable")

    ahead = PlanAhead(server.lease, server.choose, server.failed, settle=broken)
    ahead.begin(free_bytes=1000)
    assert ahead.take() is None
    assert server.errors == ["server unreachable"]
    assert len(server.leased) == 1


def test_lease_delay_is_zero_without_a_prediction_and_leaves_room_to_plan() -> None:
    assert lease_delay(None, 0.5) == 0.0
    assert lease_delay(0.0, 0.5) == 0.0
    assert lease_delay(1.0, 0.5) == 0.0  # a short run: plan at once, as before
    # a long run: lease when the planning (with its lead) ends before the run's likely end
    delay = lease_delay(10.0, 0.5)
    assert 0.0 < delay < 10.0 - 0.5
    assert lease_delay(20.0, 0.5) > delay


def test_a_delayed_lease_happens_after_the_delay() -> None:
    server = FakeServer(hand_back=set())
    ahead = PlanAhead(server.lease, server.choose, server.failed)
    ahead.begin(free_bytes=1000, delay_s=0.05)
    assert server.runnable_planned.wait(WAIT_S)
    prepared = ahead.take()
    assert prepared is not None
    assert prepared.assignment.trial_id == 1


def test_take_before_a_delayed_lease_cancels_it() -> None:
    server = FakeServer(hand_back=set())
    ahead = PlanAhead(server.lease, server.choose, server.failed)
    ahead.begin(free_bytes=1000, delay_s=WAIT_S)  # the run ends long before the lease is due
    assert ahead.take() is None
    assert server.leased == []  # nothing leased: the main thread leases itself
    ahead.begin(free_bytes=1000)  # and the next run plans ahead again
    assert ahead.take() is not None
