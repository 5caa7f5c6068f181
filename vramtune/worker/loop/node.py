"""The node loop: a node worker's trials side by side, each on cards of its own.

A node worker (``--devices cuda:0,cuda:1,...``, ``--all-gpus --node``, or ``--device cpu --ranks
N``) runs this loop instead of one trial at a time (worker/loop/agent.py). While one of its cards
is free and no leased trial waits for cards, it asks the server for a trial, stating how many
cards are free (`NextRequest.free_cards`) and what one card gives. Each trial's plan is chosen
against the whole node, as if the trial ran alone (the fewest ranks that hold it,
vramtune/worker/plan/distributed.py); the trial then takes that many free cards of the `CardBook`
(vramtune/worker/run/cards.py) and runs on exactly those:

- on one card, in a trial process of the pool (worker/run/slot_process.py) given that card's
  device (``cuda:k``; on a simulated node, one simulated card of ``--memory-limit``);
- on several, one process per rank (vramtune/worker/run/ranks.py) on those cards' devices, each rank
  seeing only its own card (``CUDA_VISIBLE_DEVICES``) or, simulated, limited to one card's size.

Why the whole node and not only the cards free now: a plan that depended on what happens to run
beside the trial would be worse by accident and for good (a trial that fits four cards as asked,
resized onto the one card free now, keeps its slower plan), or a hand-back the node could not
take back (the server never offers a trial back to the worker that handed it back, so a node
alone in its fleet would not get it again). So a trial that needs more cards than are free
waits for them, its lease renewed, and the node asks for nothing meanwhile, as an exclusive
trial on a packed card waits for the card to empty (worker/loop/packing.py). The server keeps
such waits rare: told the free cards, it offers the node no trial known to need more (a handed
back trial's world size); only a new trial's needs are unknown until it is planned.

A trial's cards stay busy until its final call is delivered: the server counts them busy while
its lease is active (the fleet page's "k of N busy"). SIGTERM stops every running trial at its
next step and each goes back to be offered again; a rank that dies or runs out of memory ends
its own trial only.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramtune.service.wire import Assignment, Plan, TrainBudget
from vramtune.worker.loop import outcomes
from vramtune.worker.loop.cycle import RunsTrials, TrialCycle
from vramtune.worker.loop.packing import Placed, TrialThreads
from vramtune.worker.plan.policy import HandBack
from vramtune.worker.run.cards import CardBook, CardGrant
from vramtune.worker.run.ranks import RankGroupRunner
from vramtune.worker.run.slot_process import SlotProcess
from vramtune.worker.trial.runner import CardSpec, Config, Reporter, RunResult


@dataclass
class _OnCard:
    """A one-card trial of a node: a pooled trial process, on the card the trial was given."""

    slot: SlotProcess
    task: str
    device: str
    limit_bytes: int

    def run(
        self, config: Config, plan: Plan, budget: TrainBudget, card: CardSpec, reporter: Reporter
    ) -> RunResult:
        """Train in the trial process on `device`, within one card of the node."""
        here = CardSpec(info=card.info, constants=dict(card.constants), device=self.device)
        return self.slot.run(self.task, config, plan, budget, here, self.limit_bytes, reporter)


class NodePacker(TrialThreads[CardBook, CardGrant]):
    """Runs a node worker's trials side by side on disjoint cards (see the module's docstring)."""

    def __init__(self, agent: TrialCycle) -> None:
        self.devices = tuple(agent.options.devices)
        # One trial process at start (a one-card trial's); the rest only when trials need them.
        super().__init__(agent, CardBook(len(self.devices), agent.free_bytes()), prestarted=1)

    def offered_bytes(self) -> int:
        """What one free card gives a new trial; 0 while every card is busy."""
        return self.book.capacity if self.book.free() else 0

    def offered_cards(self) -> int | None:
        """The cards no trial holds now."""
        return len(self.book.free())

    def _place(self, assignment: Assignment) -> bool:
        """Plan against the whole node, wait for as many free cards as the plan has ranks,
        start the trial's thread; True once that thread owns the trial."""
        agent = self.agent
        found = agent.runner_for(assignment)
        if found is None:
            return False
        runner, config = found
        chosen = agent.choose(assignment, runner, config, self.book.capacity)
        if chosen is None:
            return False
        decision, choice, how = chosen
        if isinstance(decision, HandBack):  # no card of this node holds it, however many
            agent.hand_back(assignment, decision, choice, how)
            return False
        grant = self.book.wait_to_take(
            assignment.trial_id, decision.plan.world_size, agent.stop, agent.options.idle_poll_s
        )
        if grant is None:  # stopping before its cards were free: offered again, not failed
            message = "the worker stopped before the trial's cards were free"
            agent.finish(assignment, outcomes.failed(assignment, "interrupted", message))
            return False
        self._start_thread(Placed(assignment, runner, config, decision, choice, how), grant)
        return True

    def _start_and_run(self, placed: Placed, grant: CardGrant) -> None:
        agent, decision = self.agent, placed.decision
        cards = list(grant.cards)
        agent.started(
            placed.assignment,
            decision,
            placed.choice,
            placed.how,
            cards=cards,
            beside=self.book.running() - 1,
        )
        slot = self._take_slot() if len(cards) == 1 else None
        runs: RunsTrials
        if slot is not None:
            device = self.devices[cards[0]]
            runs = _OnCard(slot, placed.assignment.task, device, self.book.capacity)
        else:
            devices = [self.devices[card] for card in cards]
            runs = RankGroupRunner(placed.runner, devices, threads=self.threads)
        try:
            agent.run_planned(
                placed.assignment,
                runs,
                placed.config,
                decision.plan,
                decision.prediction,
                decision.step_time,
                # Simulated cards share the CPU's cores: a neighbour slows the run down.
                alone=not agent.card.info.simulated,
            )
        finally:
            if slot is not None:
                self._give_slot(slot)
