"""Packing: slot accounting (worker/run/slots.py) and a trial's own process (slot_process.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.worker.test_agent_quadratic import Recorder
from vramtune.service.wire import (
    Assignment,
    CardInfo,
    Measured,
    MemoryPolicy,
    Plan,
    PlanOut,
    Prediction,
    TrainBudget,
)
from vramtune.worker.loop.agent import Agent
from vramtune.worker.loop.api import ServerClient
from vramtune.worker.loop.cycle import AgentOptions
from vramtune.worker.loop.packing import Packer
from vramtune.worker.plan.policy import RunAsPlanned
from vramtune.worker.run.slot_process import (
    STOP_CHECK_S,
    Given,
    SlotProcess,
    _outcome,
    limit_memory,
)
from vramtune.worker.run.slots import (
    SlotBook,
    cuda_memory_fraction,
    default_max_trials_per_card,
    reservation_bytes,
    threads_per_trial,
)
from vramtune.worker.tasks.quadratic import MIB, QuadraticConfig, QuadraticTask, footprint_bytes
from vramtune.worker.trial.runner import CardSpec, OutOfMemory, RunFailed, Stopped

BUDGET = TrainBudget(max_steps=6, eval_every=2)

# ---------------------------------------------------------------- the book


def test_a_reservation_keeps_the_margin_a_lone_trial_has() -> None:
    assert reservation_bytes(90, 0.10) == 100
    assert reservation_bytes(100, 0.0) == 100
    # margin is capped as the wire caps it: never a division by zero
    assert reservation_bytes(10, 1.0) == 100


def test_trials_are_packed_until_slots_or_memory_run_out() -> None:
    book = SlotBook(max_trials=3, capacity=100)
    assert book.can_ask()
    book.reserve(1, 40, exclusive=False)
    book.reserve(2, 40, exclusive=False)
    assert book.available() == 20 and book.running() == 2
    assert book.can_ask()  # a slot and 20 bytes left: a small trial may come
    assert not book.fits(30, exclusive=False)
    with pytest.raises(ValueError, match="does not fit"):
        book.reserve(3, 30, exclusive=False)
    book.reserve(3, 20, exclusive=False)
    assert not book.can_ask()  # no memory left (and no slot)
    book.release(1)
    assert book.available() == 40 and book.can_ask()


def test_the_slot_count_bounds_packing_even_with_memory_left() -> None:
    book = SlotBook(max_trials=2, capacity=1000)
    book.reserve(1, 1, exclusive=False)
    book.reserve(2, 1, exclusive=False)
    assert not book.can_ask()
    assert not book.fits(1, exclusive=False)


def test_an_exclusive_trial_waits_for_an_empty_card_and_runs_alone() -> None:
    book = SlotBook(max_trials=4, capacity=100)
    book.reserve(1, 10, exclusive=False)
    assert not book.fits(100, exclusive=True)
    book.release(1)
    book.reserve(2, 100, exclusive=True)
    assert not book.can_ask()  # nothing is asked for beside an exclusive trial
    assert not book.fits(1, exclusive=False)
    book.release(2)
    assert book.can_ask()


def test_free_memory_offered_is_what_reservations_and_the_card_leave() -> None:
    book = SlotBook(max_trials=4, capacity=100)
    book.reserve(1, 30, exclusive=False)
    assert book.available() == 70
    assert book.available(free_now=50) == 50  # another process took memory meanwhile
    assert book.available(free_now=500) == 70


def test_capacity_is_refreshed_only_while_no_trial_runs() -> None:
    book = SlotBook(max_trials=2, capacity=100)
    book.reserve(1, 30, exclusive=False)
    book.refresh_capacity(60)  # the card's free bytes with our trial on it: not the capacity
    assert book.capacity == 100
    book.release(1)
    book.refresh_capacity(120)
    assert book.capacity == 120


def test_a_waiting_trial_gets_its_slot_when_a_neighbour_releases() -> None:
    book = SlotBook(max_trials=2, capacity=100)
    book.reserve(1, 80, exclusive=False)
    stop = threading.Event()
    got: list[object] = []
    waiter = threading.Thread(
        target=lambda: got.append(book.wait_to_reserve(2, 50, False, stop, poll_s=0.05))
    )
    waiter.start()
    while book.can_ask():  # the waiter holds the asks back until it has its slot
        threading.Event().wait(0.01)
    book.release(1)
    waiter.join(10)
    assert not waiter.is_alive()
    assert [r.trial_id for r in got] == [2]  # type: ignore[attr-defined]
    assert book.reserved() == 50


def test_a_waiting_trial_gives_up_when_the_worker_stops() -> None:
    book = SlotBook(max_trials=2, capacity=100)
    book.reserve(1, 80, exclusive=False)
    stop = threading.Event()
    stop.set()
    assert book.wait_to_reserve(2, 50, False, stop, poll_s=0.01) is None
    assert book.can_ask()  # no longer waiting


def test_defaults_share_the_cores() -> None:
    assert default_max_trials_per_card(2) == 2
    assert default_max_trials_per_card(16) == 4
    assert default_max_trials_per_card(1) == 1
    assert threads_per_trial(2, cpu_count=2) == 1
    assert threads_per_trial(4, cpu_count=16) == 4
    assert threads_per_trial(8, cpu_count=2) == 1


def test_the_cuda_fraction_caps_the_allocator_below_the_context() -> None:
    gib = 2**30
    assert cuda_memory_fraction(2 * gib + gib // 2, gib // 2, 80 * gib) == pytest.approx(2 / 80)
    assert cuda_memory_fraction(gib, 2 * gib, 80 * gib) == 0.0
    assert cuda_memory_fraction(100 * gib, 0, 80 * gib) == 1.0
    with pytest.raises(ValueError):
        cuda_memory_fraction(1, 0, 0)


# ---------------------------------------------------------------- which trials pack


def assignment(policy: MemoryPolicy, plans_tried: list[dict[str, Any]] | None = None) -> Assignment:
    return Assignment(
        trial_id=1,
        number=0,
        attempt=0,
        lease="l",
        lease_expires_at=datetime.now(UTC),
        study="s",
        task="quadratic",
        params={},
        task_config={},
        budget=BUDGET,
        memory_policy=policy,
        n_objectives=1,
        plans_tried=[PlanOut.model_validate(plan) for plan in plans_tried or []],
    )


def test_only_predicted_trials_of_packing_studies_are_packed_and_oom_retries_run_alone() -> None:
    card = simulated(100 * MIB)
    options = AgentOptions(name="packer", max_trials_per_card=2)
    agent = Agent(ServerClient("http://127.0.0.1:9"), {"quadratic": QuadraticTask()}, card, options)
    packer = Packer(agent)
    assert packer.book.capacity == 100 * MIB
    prediction = Prediction(peak_allocated_bytes=18 * MIB, peak_reserved_bytes=18 * MIB)
    decision = RunAsPlanned(Plan(), prediction)
    packing = MemoryPolicy(allow_packing=True, margin=0.1)
    assert packer.hold_for(assignment(packing), decision, 100 * MIB) == (20 * MIB, False)
    alone = MemoryPolicy(allow_packing=False)
    assert packer.hold_for(assignment(alone), decision, 100 * MIB) == (100 * MIB, True)
    retried = assignment(packing, plans_tried=[{"micro_batch": None}])
    assert packer.hold_for(retried, decision, 100 * MIB) == (100 * MIB, True)
    blind = RunAsPlanned(
        Plan(), Prediction(peak_allocated_bytes=0, peak_reserved_bytes=0, method="none")
    )
    assert packer.hold_for(assignment(packing), blind, 100 * MIB) == (100 * MIB, True)


# ---------------------------------------------------------------- a trial's own process


def simulated(nbytes: int) -> CardSpec:
    info = CardInfo(model="sim", total_bytes=nbytes, free_bytes=nbytes, simulated=True)
    return CardSpec(info=info)


@pytest.fixture(scope="module")
def slot() -> Iterator[SlotProcess]:
    """One slot process for the module's tests (spawned once, as a worker reuses it)."""
    process = SlotProcess(Given({"quadratic": QuadraticTask()}), threads=1)
    yield process
    process.close()
    assert not process.alive


CONFIG = {"batch_size": 64, "width": 32, "step_seconds": 0.0}


def test_a_trial_runs_in_its_process_with_reports_answered_by_the_agent(slot: SlotProcess) -> None:
    recorder = Recorder()
    result = slot.run("quadratic", CONFIG, Plan(), BUDGET, simulated(2**30), 2**30, recorder)
    assert result.steps == 6
    assert [step for step, _ in recorder.reports] == [2, 4, 6]
    assert 1 <= recorder.checks <= 6  # the first step's at once, then at most every 50 ms
    peak = footprint_bytes(QuadraticConfig.of(CONFIG), Plan())
    assert result.measured.peak_allocated_bytes == peak


def test_a_trial_past_its_reservation_runs_out_of_memory_in_its_process(slot: SlotProcess) -> None:
    peak = footprint_bytes(QuadraticConfig.of(CONFIG), Plan())
    with pytest.raises(OutOfMemory, match="simulated OOM"):
        # the card holds it; the reservation the process is limited to does not
        slot.run("quadratic", CONFIG, Plan(), BUDGET, simulated(2**30), peak - 1, Recorder())
    # the process survives its trial's OOM and runs the next one
    result = slot.run("quadratic", CONFIG, Plan(), BUDGET, simulated(2**30), peak, Recorder())
    assert result.steps == 6


def test_prune_and_stop_orders_reach_the_trial_in_its_process(slot: SlotProcess) -> None:
    with pytest.raises(Stopped) as pruned:
        slot.run("quadratic", CONFIG, Plan(), BUDGET, simulated(2**30), 2**30, Recorder(prune_at=4))
    assert pruned.value.reason == "pruned"
    # Steps longer than the stop-check period: every step asks, the 4th is told to stop.
    slow = {**CONFIG, "step_seconds": STOP_CHECK_S * 1.5}
    recorder = Recorder(stop_after=3)
    with pytest.raises(Stopped) as stopped:
        slot.run("quadratic", slow, Plan(), BUDGET, simulated(2**30), 2**30, recorder)
    assert stopped.value.reason == "interrupted"
    assert recorder.checks == 4


def test_a_broken_configuration_fails_its_trial_not_the_process(slot: SlotProcess) -> None:
    with pytest.raises(RuntimeError, match="batch_size must be >= 1"):
        slot.run(
            "quadratic", {"batch_size": 0}, Plan(), BUDGET, simulated(2**30), 2**30, Recorder()
        )
    with pytest.raises(RuntimeError, match="not installed"):
        slot.run("nope", CONFIG, Plan(), BUDGET, simulated(2**30), 2**30, Recorder())
    assert slot.alive


def test_the_simulated_card_a_packed_trial_sees_is_its_reservation() -> None:
    limited = limit_memory(simulated(2**30), 5 * MIB)
    assert limited.info.total_bytes == limited.info.free_bytes == 5 * MIB
    assert limited.info.model == "sim"  # same card model: calibration and plans_tried still apply


def test_each_end_of_a_run_in_its_process_comes_back_as_the_runner_raises_it() -> None:
    measured = Measured(peak_allocated_bytes=7)
    with pytest.raises(RunFailed) as failed:
        _outcome(("done", "failed", "accuracy is nan after 3 steps", measured))
    assert failed.value.measured == measured  # a run that trained keeps its peak
    with pytest.raises(OutOfMemory) as oom:
        _outcome(("done", "oom", "out of memory", measured))
    assert oom.value.measured == measured
    with pytest.raises(RuntimeError, match="bad config"):
        _outcome(("done", "error", "bad config"))
