"""The distributed rungs of the plan ladder: more cards or resizing on one (issue 31).

For a study with a `distributed` policy the ladder is: as asked on one card → as asked on the
fewest ranks whose per-rank prediction fits a card of this node (at each world size the
study's strategies in its order, FSDP2 twice: keeping its parameters gathered after forward,
then resharding them, the least memory) → the single-card rungs of vramtune.worker.plan.policy
(micro-batches, checkpointing, bf16) → a hand-back that names, for each world size the study
allows, the strategy and per-rank bytes it needs, so the server can route it to a node with
that many free cards of that size. With `prefer: fewest_cards` (the default) running as asked
on more cards comes before resizing on one: it keeps the step as the user wrote it and spreads
its cost over cards. With `prefer: fastest` every plan that fits past the first rung (each
world size and wrapper as asked, and the single-card resized plan) is ranked by the step-time
model's predicted step time (the fleet's fit for this card and task, which learns each world
size's and wrapper's cost; the fixed model before it has runs) and the fastest runs; a plan is
traced only while it could still beat the fastest found.

The per-rank prediction is rank 0 traced on a fake process group
(worker.predictor.distributed.trace_rank); the global batch stays the hyperparameter (each rank
runs batch / world size), so only world sizes that divide the batch are tried.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vramtune.common.memory import peak_of
from vramtune.common.plans import ranks_in_words
from vramtune.common.step_time import default_step_time_fit, predicted_step_s, step_time_slowdown
from vramtune.service.wire import (
    DistributedPolicy,
    MemoryPolicy,
    Plan,
    Prediction,
    RankNeed,
    StepTimeFit,
    Strategy,
)
from vramtune.worker.plan.policy import Decision, HandBack, RunAsPlanned, step_features
from vramtune.worker.trial.runner import CardSpec, Config

if TYPE_CHECKING:  # the agent imports this module without torch; tracing imports it late
    from vramtune.worker.trial.task import Task

SingleCard = Callable[[MemoryPolicy], Decision]
"""vramtune.worker.plan.policy.choose_plan on this card under the given memory policy."""


@dataclass(frozen=True)
class DistributedHandBack(HandBack):
    """A hand-back that also names what the trial needs on several cards."""

    rank_needs: tuple[RankNeed, ...] = ()


def world_sizes(batch: int, policy: DistributedPolicy, cards: int) -> list[int]:
    """World sizes above 1 the trial may use on `cards` cards: those that divide the batch."""
    most = min(policy.max_world_size, cards)
    return [size for size in range(2, most + 1) if batch % size == 0]


def plans_at(size: int, strategies: list[Strategy]) -> list[Plan]:
    """The plans at `size` ranks in the ladder's order: each strategy in the study's order,
    FSDP2 keeping its parameters gathered (one all-gather a step fewer) before resharding them
    after forward (usually the least memory)."""
    plans = []
    for strategy in strategies:
        if strategy == "fsdp":
            plans.append(Plan(world_size=size, strategy="fsdp", reshard_after_forward=False))
        plans.append(Plan(world_size=size, strategy=strategy))
    return plans


def rank_prediction(task: Task, config: Config, plan: Plan, card: CardSpec) -> Prediction:
    """Rank 0's predicted peak under `plan` (its world size and strategy) on one card."""
    from vramtune.worker.predictor.distributed import trace_rank

    assert plan.strategy is not None, "a per-rank prediction needs a strategy"
    traced = trace_rank(task, config, plan, plan.strategy, plan.world_size)
    reserved = traced.reserved_bytes if card.device.startswith("cuda") else traced.allocated_bytes
    return Prediction(
        peak_allocated_bytes=traced.allocated_bytes,
        peak_reserved_bytes=reserved,
        breakdown=traced.breakdown,
        seconds=round(traced.seconds, 4),
    )


def choose_distributed(
    task: Task,
    config: Config,
    policy: MemoryPolicy,
    distributed: DistributedPolicy,
    card: CardSpec,
    free_bytes: int,
    cards: int,
    single_card: SingleCard,
    step_fit: StepTimeFit | None = None,
) -> Decision:
    """The ladder of the module docstring for a node of `cards` cards of `free_bytes` each.

    `step_fit`: the fleet's step-time model for this card model and task (None: the fixed
    model), which `prefer: fastest` ranks the plans by and every run's features carry.
    """
    started = time.perf_counter()
    ladder = _Ladder(task, config, policy, distributed, card, free_bytes, step_fit)
    decision = ladder.choose(cards, single_card)
    return dataclasses.replace(decision, seconds=time.perf_counter() - started)


class _Ladder:
    """One trial's distributed choice: its budget per card, its batch, its step-time model."""

    def __init__(
        self,
        task: Task,
        config: Config,
        policy: MemoryPolicy,
        distributed: DistributedPolicy,
        card: CardSpec,
        free_bytes: int,
        step_fit: StepTimeFit | None,
    ) -> None:
        self.task = task
        self.config = config
        self.policy = policy
        self.distributed = distributed
        self.card = card
        self.budget = int(free_bytes * (1.0 - policy.margin))
        self.batch = int(config[task.batch_size_param])
        self.fit = step_fit or default_step_time_fit()

    def choose(self, cards: int, single_card: SingleCard) -> Decision:
        as_asked = single_card(self.policy.model_copy(update={"allow_resize": False}))
        if isinstance(as_asked, RunAsPlanned):
            return as_asked
        plans = [
            plan
            for size in world_sizes(self.batch, self.distributed, cards)
            for plan in plans_at(size, self.distributed.strategies)
        ]
        work = as_asked.min_footprint_bytes
        if self.distributed.prefer == "fastest":
            return self.fastest(plans, work, as_asked, single_card)
        for plan in plans:
            found = self.fitting(plan, work, "fewest ranks that hold it as asked")
            if found is not None:
                return found
        resized = single_card(self.policy) if self.policy.allow_resize else as_asked
        return resized if isinstance(resized, RunAsPlanned) else self.hand_back(resized)

    def fastest(
        self, plans: list[Plan], work: int, as_asked: HandBack, single_card: SingleCard
    ) -> Decision:
        """The fitting plan of least predicted step time: the single-card resized plan or a
        plan on more cards, traced in order of predicted time until one fits (ties go to the
        fewer cards: the resized plan, then the ladder's order). A resized plan chosen without
        a prediction has no step time to compare: any plan on more cards that fits wins."""
        resized = single_card(self.policy) if self.policy.allow_resize else as_asked
        bound = None
        if isinstance(resized, RunAsPlanned) and resized.step_time is not None:
            bound = step_time_slowdown(self.fit, resized.step_time)
        timed = [(self.slowdown(plan), plan) for plan in plans]
        for slowdown, plan in sorted(timed, key=lambda pair: pair[0]):  # stable: ladder order
            if bound is not None and slowdown >= bound:
                break
            words = f"fastest plan that fits: predicted {slowdown:.2f}x as asked on one card"
            if bound is not None:
                words += f", resized on one card {bound:.2f}x"
            found = self.fitting(plan, work, words)
            if found is not None:
                return found
        if not isinstance(resized, RunAsPlanned):
            return self.hand_back(resized)
        reason = f"{resized.plan.reason}; no plan on more cards that fits is predicted faster"
        return dataclasses.replace(resized, plan=resized.plan.model_copy(update={"reason": reason}))

    def slowdown(self, plan: Plan) -> float:
        """`plan`'s predicted time per step relative to as asked on one card."""
        return step_time_slowdown(self.fit, step_features(plan, self.batch))

    def fitting(self, plan: Plan, work: int, why: str) -> RunAsPlanned | None:
        """`plan` to run, when rank 0's prediction fits the budget; None when not."""
        prediction = rank_prediction(self.task, self.config, plan, self.card)
        if peak_of(prediction) > self.budget:
            return None
        # The step-time model learns each world size's cost from these runs.
        features = step_features(plan, self.batch, prediction, work)
        features = features.model_copy(
            update={"predicted_step_s": predicted_step_s(self.fit, features)}
        )
        reason = (
            f"{ranks_in_words(plan)}: {peak_of(prediction):,} bytes per rank predicted, "
            f"within {self.budget:,} per card ({why})"
        )
        return RunAsPlanned(plan.model_copy(update={"reason": reason}), prediction, features)

    def hand_back(self, single: HandBack) -> DistributedHandBack:
        needs = rank_needs(self.task, self.config, self.distributed, self.card, self.batch)
        said = "; ".join(
            f"{n.world_size} ranks ({n.strategy}): {n.per_rank_bytes:,} bytes per rank"
            for n in needs
        )
        reason = f"{single.reason}; on several cards: {said or 'no world size divides the batch'}"
        return DistributedHandBack(
            min_footprint_bytes=single.min_footprint_bytes,
            plan=single.plan,
            reason=reason,
            rank_needs=tuple(needs),
        )


def rank_needs(
    task: Task, config: Config, distributed: DistributedPolicy, card: CardSpec, batch: int
) -> list[RankNeed]:
    """At each world size the study allows, the strategy needing the least per rank. FSDP2
    keeping its parameters gathered is traced too: it usually needs more than resharding, but
    not always (resharding gathers them again in backward, beside the gradients)."""
    needs = []
    for size in world_sizes(batch, distributed, distributed.max_world_size):
        plans = plans_at(size, distributed.strategies)
        predicted = [(plan, rank_prediction(task, config, plan, card)) for plan in plans]
        plan, prediction = min(predicted, key=lambda found: peak_of(found[1]))
        strategy: Strategy = plan.strategy or "ddp"
        bytes_needed = peak_of(prediction)
        needs.append(RankNeed(world_size=size, strategy=strategy, per_rank_bytes=bytes_needed))
    return needs
