"""The distributed rungs of the plan ladder: the fewest ranks that hold a trial (issue 31).

For a study with a `distributed` policy the ladder is: as asked on one card → as asked on the
fewest ranks whose per-rank prediction fits a card of this node (at each world size DDP before
FSDP2, each strategy in the order the study lists them) → the single-card rungs of
worker.plan.policy (micro-batches, checkpointing, bf16) → a hand-back that names, for each world
size the study allows, the strategy and per-rank bytes it needs, so the server can route it to a
node with that many free cards of that size. Running as asked on more cards comes before
resizing on one: it keeps the step as the user wrote it and spreads its cost over cards.

The per-rank prediction is rank 0 traced on a fake process group
(worker.predictor.distributed.trace_rank); the global batch stays the hyperparameter (each rank
runs batch / world size), so only world sizes that divide the batch are tried.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.memory import peak_of
from service.wire import DistributedPolicy, MemoryPolicy, Plan, Prediction, RankNeed, Strategy
from worker.plan.policy import Decision, HandBack, RunAsPlanned, step_features
from worker.trial.runner import CardSpec, Config

if TYPE_CHECKING:  # the agent imports this module without torch; tracing imports it late
    from worker.trial.task import Task

SingleCard = Callable[[MemoryPolicy], Decision]
"""worker.plan.policy.choose_plan on this card under the given memory policy."""


@dataclass(frozen=True)
class DistributedHandBack(HandBack):
    """A hand-back that also names what the trial needs on several cards."""

    rank_needs: tuple[RankNeed, ...] = ()


def world_sizes(batch: int, policy: DistributedPolicy, cards: int) -> list[int]:
    """World sizes above 1 the trial may use on `cards` cards: those that divide the batch."""
    most = min(policy.max_world_size, cards)
    return [size for size in range(2, most + 1) if batch % size == 0]


def rank_prediction(task: Task, config: Config, plan: Plan, card: CardSpec) -> Prediction:
    """Rank 0's predicted peak under `plan` (its world size and strategy) on one card."""
    from worker.predictor.distributed import trace_rank

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
) -> Decision:
    """The ladder of the module docstring for a node of `cards` cards of `free_bytes` each."""
    started = time.perf_counter()
    decision = _choose(task, config, policy, distributed, card, free_bytes, cards, single_card)
    return dataclasses.replace(decision, seconds=time.perf_counter() - started)


def _choose(
    task: Task,
    config: Config,
    policy: MemoryPolicy,
    distributed: DistributedPolicy,
    card: CardSpec,
    free_bytes: int,
    cards: int,
    single_card: SingleCard,
) -> Decision:
    as_asked = single_card(policy.model_copy(update={"allow_resize": False}))
    if isinstance(as_asked, RunAsPlanned):
        return as_asked
    budget = int(free_bytes * (1.0 - policy.margin))
    batch = int(config[task.batch_size_param])
    for size in world_sizes(batch, distributed, cards):
        for plan, prediction in _predicted(task, config, distributed, card, size):
            if peak_of(prediction) <= budget:
                # The step-time model learns each world size's cost from these runs.
                work = as_asked.min_footprint_bytes
                features = step_features(plan, batch, prediction, work)
                return RunAsPlanned(_explained(plan, prediction, budget), prediction, features)
    resized = single_card(policy) if policy.allow_resize else as_asked
    if isinstance(resized, RunAsPlanned):
        return resized
    return _hand_back(task, config, distributed, card, resized, batch)


def _predicted(
    task: Task, config: Config, distributed: DistributedPolicy, card: CardSpec, size: int
) -> Iterator[tuple[Plan, Prediction]]:
    """Each allowed strategy's plan at `size` ranks with its per-rank prediction, in order."""
    for strategy in distributed.strategies:
        plan = Plan(world_size=size, strategy=strategy)
        yield plan, rank_prediction(task, config, plan, card)


def _explained(plan: Plan, prediction: Prediction, budget: int) -> Plan:
    """The plan with a reason naming its world size, strategy and per-rank bytes."""
    reason = (
        f"{plan.world_size} ranks, {plan.strategy}: {peak_of(prediction):,} bytes per rank "
        f"predicted, within {budget:,} per card (fewest ranks that hold it as asked)"
    )
    return plan.model_copy(update={"reason": reason})


def rank_needs(
    task: Task, config: Config, distributed: DistributedPolicy, card: CardSpec, batch: int
) -> list[RankNeed]:
    """At each world size the study allows, the strategy needing the least per rank."""
    needs = []
    for size in world_sizes(batch, distributed, distributed.max_world_size):
        predicted = list(_predicted(task, config, distributed, card, size))
        plan, prediction = min(predicted, key=lambda found: peak_of(found[1]))
        strategy: Strategy = plan.strategy or "ddp"
        bytes_needed = peak_of(prediction)
        needs.append(RankNeed(world_size=size, strategy=strategy, per_rank_bytes=bytes_needed))
    return needs


def _hand_back(
    task: Task,
    config: Config,
    distributed: DistributedPolicy,
    card: CardSpec,
    single: HandBack,
    batch: int,
) -> DistributedHandBack:
    needs = rank_needs(task, config, distributed, card, batch)
    said = "; ".join(
        f"{n.world_size} ranks ({n.strategy}): {n.per_rank_bytes:,} bytes per rank" for n in needs
    )
    reason = f"{single.reason}; on several cards: {said or 'no world size divides the batch'}"
    return DistributedHandBack(
        min_footprint_bytes=single.min_footprint_bytes,
        plan=single.plan,
        reason=reason,
        rank_needs=tuple(needs),
    )
