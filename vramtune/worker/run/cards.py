"""Card accounting for a node worker that runs several trials at once, each on its own cards.

A node worker (``--devices cuda:0,1,2,3``, or ``--device cpu --ranks N``) keeps a `CardBook`:
which of its cards each running trial holds. A trial's plan says how many cards it runs on
(`Plan.world_size`); it takes that many free cards, the lowest-numbered first, and holds them
until its final call is delivered: the server counts a card busy while the lease of the trial
on it is active (vramtune/service/dashboard/fleet.py), so the worker frees it no earlier.

The worker asks the server for work while a card is free and no leased trial waits for cards,
stating how many cards are free (`NextRequest.free_cards`): the server then offers it no trial
that is known to need more (service/fleet/dispatch.py). A new trial's needs are known only once
it is planned: one that needs more cards than are free waits, its lease renewed, for its
neighbours to end (as an exclusive trial of a packed card waits for the card to empty).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from vramtune.worker.run.slots import TrialBook


@dataclass(frozen=True)
class CardGrant:
    """The cards one trial holds, by their index in the node's list of devices."""

    trial_id: int
    cards: tuple[int, ...]


class CardBook(TrialBook[CardGrant]):
    """Which of a node's cards each running trial holds. `capacity` is what each card gives
    this worker with no trial of it running."""

    def __init__(self, cards: int, capacity: int) -> None:
        if cards < 1:
            raise ValueError(f"a node has at least one card, got {cards}")
        super().__init__(cards, capacity)  # at most one trial per card
        self._cards = cards

    @property
    def cards(self) -> int:
        """How many cards the node has."""
        return self._cards

    def free(self) -> tuple[int, ...]:
        """The cards no trial holds, lowest index first."""
        with self._changed:
            return self._free()

    def can_ask(self) -> bool:
        """Whether to ask the server for another trial: a free card, no trial waiting for
        cards, and memory on a card."""
        with self._changed:
            return bool(self._free()) and self._waiting == 0 and self._capacity > 0

    def take(self, trial_id: int, count: int) -> CardGrant:
        """Hold `count` free cards for the trial; ValueError if that many are not free now."""
        with self._changed:
            self._check(trial_id, count)
            if len(self._free()) < count:
                raise ValueError(f"trial {trial_id} needs {count} cards, {self._state()}")
            return self._grant(trial_id, count)

    def wait_to_take(
        self, trial_id: int, count: int, stop: threading.Event, poll_s: float
    ) -> CardGrant | None:
        """Hold `count` cards as soon as that many are free; None if `stop` is set first.
        Until then no new trial is asked for (`can_ask` is False)."""
        with self._changed:
            self._check(trial_id, count)
            return self._wait_to_hold(
                lambda: len(self._free()) >= count,
                lambda: self._grant(trial_id, count),
                stop,
                poll_s,
            )

    def _check(self, trial_id: int, count: int) -> None:
        if trial_id in self._held:
            raise ValueError(f"trial {trial_id} holds cards already")
        if not 1 <= count <= self._cards:
            raise ValueError(f"trial {trial_id} needs {count} cards; the node has {self._cards}")

    def _grant(self, trial_id: int, count: int) -> CardGrant:
        grant = CardGrant(trial_id, self._free()[:count])
        self._held[trial_id] = grant
        return grant

    def _free(self) -> tuple[int, ...]:
        held = {card for grant in self._held.values() for card in grant.cards}
        return tuple(card for card in range(self._cards) if card not in held)

    def _state(self) -> str:
        return f"{len(self._free())} of {self._cards} cards free"
