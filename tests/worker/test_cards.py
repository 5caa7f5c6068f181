"""The card book of a node worker: which trial holds which cards, waits, and when to ask."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from tests.worker.test_agent_quadratic import Recorder
from vramtune.service.wire import CardInfo, Plan, TrainBudget
from vramtune.worker.loop.agent import Agent
from vramtune.worker.loop.api import ServerClient
from vramtune.worker.loop.cycle import AgentOptions
from vramtune.worker.loop.node import NodePacker, _OnCard
from vramtune.worker.run.cards import CardBook, CardGrant
from vramtune.worker.run.slot_process import SlotProcess
from vramtune.worker.tasks.quadratic import QuadraticTask
from vramtune.worker.trial.runner import CardSpec

MIB = 2**20


def test_trials_take_the_lowest_free_cards_and_give_them_back() -> None:
    book = CardBook(4, 12 * MIB)
    assert book.free() == (0, 1, 2, 3) and book.can_ask()
    assert book.take(7, 1) == CardGrant(7, (0,))
    assert book.take(8, 2) == CardGrant(8, (1, 2))
    assert book.free() == (3,) and book.running() == 2
    book.release(7)
    assert book.take(9, 2) == CardGrant(9, (0, 3))  # disjoint from trial 8's cards
    assert book.free() == () and not book.can_ask()
    book.release(8)
    book.release(9)
    assert book.free() == (0, 1, 2, 3) and book.running() == 0


def test_a_trial_that_needs_more_cards_than_are_free_is_refused_or_waits() -> None:
    book = CardBook(4, 12 * MIB)
    book.take(1, 3)
    with pytest.raises(ValueError, match="needs 2 cards, 1 of 4 cards free"):
        book.take(2, 2)
    with pytest.raises(ValueError, match="the node has 4"):
        book.take(2, 5)
    with pytest.raises(ValueError, match="holds cards already"):
        book.take(1, 1)
    granted: list[CardGrant | None] = []
    waiter = threading.Thread(
        target=lambda: granted.append(book.wait_to_take(2, 2, threading.Event(), 0.05))
    )
    waiter.start()
    time.sleep(0.2)
    assert not granted and not book.can_ask()  # a card is free, but a trial waits for two
    book.release(1)
    waiter.join(5)
    assert granted == [CardGrant(2, (0, 1))]
    assert book.can_ask()


def test_a_wait_for_cards_ends_when_the_worker_stops() -> None:
    book = CardBook(2, 12 * MIB)
    book.take(1, 1)
    stop = threading.Event()
    stop.set()
    assert book.wait_to_take(2, 2, stop, 0.01) is None
    assert book.free() == (1,) and book.can_ask()  # nothing held, no longer waiting


def test_the_capacity_is_read_while_no_trial_runs_and_no_memory_means_no_ask() -> None:
    book = CardBook(2, 12 * MIB)
    book.take(1, 1)
    book.refresh_capacity(5 * MIB)  # our own trial uses the card: not a new reading
    assert book.capacity == 12 * MIB
    book.release(1)
    book.refresh_capacity(0)
    assert book.capacity == 0 and not book.can_ask()
    with pytest.raises(ValueError, match="at least one card"):
        CardBook(0, MIB)


# ---------------------------------------------------------------- the node loop's side


def _node_agent(cards: int) -> Agent:
    info = CardInfo(model="sim", total_bytes=12 * MIB, free_bytes=12 * MIB, simulated=True)
    options = AgentOptions(name="node", device="cpu", devices=("cpu",) * cards)
    client = ServerClient("http://127.0.0.1:9")  # never called here
    return Agent(client, {"quadratic": QuadraticTask()}, CardSpec(info=info), options)


def test_a_node_tells_the_server_its_free_cards_and_what_one_card_gives() -> None:
    packer = NodePacker(_node_agent(4))
    assert (packer.offered_cards(), packer.offered_bytes()) == (4, 12 * MIB)
    packer.book.take(1, 3)
    assert (packer.offered_cards(), packer.offered_bytes()) == (1, 12 * MIB)
    packer.book.take(2, 1)
    assert (packer.offered_cards(), packer.offered_bytes()) == (0, 0)


@dataclass
class _Slot:
    """A trial process that records what it was asked to run."""

    asked: list[tuple[str, int]] = field(default_factory=list)

    def run(self, task: str, config: Any, plan: Plan, budget: Any, card: CardSpec, limit: int,
            reporter: Any) -> Any:  # fmt: skip
        self.asked.append((card.device, limit))
        return "ran"


def test_a_one_card_trial_of_a_node_runs_on_the_card_it_was_given() -> None:
    slot = _Slot()
    on_card = _OnCard(cast(SlotProcess, slot), "quadratic", "cuda:2", 12 * MIB)
    card = CardSpec(
        info=CardInfo(model="H100", total_bytes=80 * 2**30, free_bytes=0), device="cuda:0"
    )
    assert on_card.run({}, Plan(), TrainBudget(), card, Recorder()) == "ran"
    assert slot.asked == [("cuda:2", 12 * MIB)]
