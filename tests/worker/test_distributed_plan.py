"""The distributed rungs of the plan ladder: as asked on one card, then the fewest ranks (DDP,
FSDP2 keeping its parameters gathered, FSDP2 resharding after forward), then the single-card
resizes, then a hand-back naming each world size's need; with `prefer: fastest`, the fitting plan
of least predicted step time instead.

digits-cnn (width 16, resolution 32) on 12 MiB simulated cards, 10 % margin (11.3 MB): batch 16
needs 5.2 MB on one card; batch 64 needs 20.3 MB, 10.3 MB a rank on 2; batch 256 needs 10.2 MB a
rank on 8 (tests/e2e/test_multigpu.py uses the same sizes). A wide, low-resolution digits-cnn
(width 96, resolution 8, batch 8: parameter-heavy) tells FSDP2's two ways apart: on 2 ranks DDP
needs 21.4 MB a rank, FSDP2 keeping its parameters gathered 12.64 MB, resharding 12.36 MB.
Cost: a few traces of a second or two each per test.
"""

from __future__ import annotations

import pytest

from vramtune.common.step_time import default_step_time_fit
from vramtune.service.wire import DistributedPolicy, MemoryPolicy, Plan, StepTimeFit
from vramtune.worker.device.gpu import parse_size, simulated_card
from vramtune.worker.plan.distributed import (
    DistributedHandBack,
    choose_distributed,
    plans_at,
    rank_prediction,
    world_sizes,
)
from vramtune.worker.plan.policy import Decision, RunAsPlanned, choose_plan
from vramtune.worker.run.training import TorchTaskRunner
from vramtune.worker.tasks.digits import DigitsCNNTask
from vramtune.worker.trial.runner import CardSpec

TASK = DigitsCNNTask()
RUNNER = TorchTaskRunner(TASK)
CARD = CardSpec(info=simulated_card(parse_size("12MiB")))
FREE = CARD.info.total_bytes
AS_ASKED_ONLY = MemoryPolicy(allow_resize=False)
BOTH = DistributedPolicy()


def _config(batch: int) -> dict[str, int]:
    return {"width": 16, "depth": 2, "resolution": 32, "batch_size": batch}


WIDE = {"width": 96, "depth": 3, "resolution": 8, "batch_size": 8}
FASTEST = DistributedPolicy(prefer="fastest")


def _choose(
    batch: int,
    cards: int,
    policy: MemoryPolicy = AS_ASKED_ONLY,
    distributed: DistributedPolicy = BOTH,
    config: dict[str, int] | None = None,
    free: int = FREE,
    fit: StepTimeFit | None = None,
) -> Decision:
    config = config or _config(batch)
    card = CardSpec(info=simulated_card(free))

    def on_one_card(given: MemoryPolicy) -> Decision:
        return choose_plan(RUNNER, config, given, card, free, step_fit=fit)

    return choose_distributed(
        TASK, config, policy, distributed, card, free, cards, on_one_card, step_fit=fit
    )


def _ran_as(decision: Decision) -> tuple[int, str | None, bool]:
    assert isinstance(decision, RunAsPlanned), decision
    plan = decision.plan
    return plan.world_size, plan.strategy, plan.reshard_after_forward


def test_world_sizes_divide_the_batch_within_the_cards_and_the_policy() -> None:
    assert world_sizes(12, BOTH, cards=8) == [2, 3, 4, 6]
    assert world_sizes(64, DistributedPolicy(max_world_size=2), cards=8) == [2]
    assert world_sizes(64, BOTH, cards=1) == []


def test_what_fits_one_card_as_asked_runs_on_one() -> None:
    decision = _choose(16, cards=4)
    assert isinstance(decision, RunAsPlanned)
    assert decision.plan.world_size == 1 and decision.plan.strategy is None


@pytest.mark.parametrize(
    ("strategies", "chosen", "words"),
    [(["ddp", "fsdp"], "ddp", "ddp"), (["fsdp"], "fsdp", "fsdp keeping parameters gathered")],
)
def test_the_fewest_ranks_that_hold_it_in_the_study_s_order(
    strategies: list[str], chosen: str, words: str
) -> None:
    decision = _choose(
        64, cards=4, distributed=DistributedPolicy.model_validate({"strategies": strategies})
    )
    assert isinstance(decision, RunAsPlanned)
    plan = decision.plan
    assert (plan.world_size, plan.strategy) == (2, chosen)
    per_rank = decision.prediction.peak_allocated_bytes
    assert per_rank <= FREE * 0.9
    assert f"2 ranks, {words}: {per_rank:,} bytes per rank" in plan.reason
    # What the step-time model learns from the run: one rank's share, the ranks, the wrapper.
    features = decision.step_time
    assert features is not None
    assert (features.world_size, features.strategy) == (2, chosen)
    assert (features.batch_size, features.micro_batch, features.micro_batches) == (64, 32, 1)
    assert features.as_asked_peak_bytes > FREE  # the one-card footprint: the trial's work


def test_more_cards_come_before_resizing_on_one() -> None:
    decision = _choose(64, cards=4, policy=MemoryPolicy())
    assert isinstance(decision, RunAsPlanned)
    assert decision.plan.world_size == 2 and decision.plan.accumulation == 1
    alone = _choose(64, cards=1, policy=MemoryPolicy())  # a 1-card worker resizes instead
    assert isinstance(alone, RunAsPlanned)
    assert alone.plan.world_size == 1 and alone.plan.accumulation > 1


def test_a_hand_back_names_each_world_size_s_need() -> None:
    decision = _choose(256, cards=4)
    assert isinstance(decision, DistributedHandBack)
    needs = {need.world_size: need for need in decision.rank_needs}
    assert sorted(needs) == [2, 4, 8]
    assert needs[8].per_rank_bytes <= FREE * 0.9 < needs[4].per_rank_bytes
    assert needs[2].per_rank_bytes > needs[4].per_rank_bytes > needs[8].per_rank_bytes
    assert "8 ranks" in decision.reason


def test_at_each_world_size_ddp_then_fsdp_keeping_parameters_gathered_then_resharding() -> None:
    assert plans_at(2, ["ddp", "fsdp"]) == [
        Plan(world_size=2, strategy="ddp"),
        Plan(world_size=2, strategy="fsdp", reshard_after_forward=False),
        Plan(world_size=2, strategy="fsdp"),
    ]
    assert [p.strategy for p in plans_at(4, ["fsdp", "ddp"])] == ["fsdp", "fsdp", "ddp"]


def _per_rank(plan: Plan) -> int:
    return rank_prediction(TASK, WIDE, plan, CARD).peak_allocated_bytes


@pytest.mark.parametrize(
    ("free", "chosen"),
    [("14.5MiB", (2, "fsdp", False)), ("13.25MiB", (2, "fsdp", True))],
)
def test_fsdp_keeps_its_parameters_gathered_where_that_fits_and_reshards_where_not(
    free: str, chosen: tuple[int, str, bool]
) -> None:
    ddp, gathered, resharding = (_per_rank(plan) for plan in plans_at(2, ["ddp", "fsdp"]))
    budget = parse_size(free) * 0.9
    assert resharding < gathered < ddp and ddp > budget  # the sizes the module docstring gives
    decision = _choose(8, cards=4, config=WIDE, free=parse_size(free))
    assert _ran_as(decision) == chosen
    assert isinstance(decision, RunAsPlanned)
    kept = "keeping parameters gathered" in decision.plan.reason
    assert kept == (not chosen[2]) and "fewest ranks that hold it as asked" in decision.plan.reason
    features = decision.step_time
    assert features is not None and features.reshard_after_forward == chosen[2]


def test_fastest_takes_more_ranks_when_the_model_predicts_them_faster() -> None:
    """The fixed model: 4 ranks run a step in less time than 2 (each its share of the batch);
    DDP does not fit 4 ranks, FSDP2 keeping its parameters gathered does."""
    free = parse_size("13.25MiB")
    assert _ran_as(_choose(8, cards=4, config=WIDE, free=free)) == (2, "fsdp", True)
    decision = _choose(8, cards=4, config=WIDE, free=free, distributed=FASTEST)
    assert _ran_as(decision) == (4, "fsdp", False)
    assert isinstance(decision, RunAsPlanned)
    assert "fastest plan that fits: predicted 0.75x as asked on one card" in decision.plan.reason


def test_fastest_resizes_on_one_card_when_the_model_says_more_cards_cost_more() -> None:
    """A fleet fit where each doubling of the ranks costs 8x: micro-batches on one card win;
    with the fixed model 4 ranks of DDP do (fewest_cards: 2)."""
    resizing = MemoryPolicy()
    assert _ran_as(_choose(64, cards=4, policy=resizing)) == (2, "ddp", True)
    assert _ran_as(_choose(64, cards=4, policy=resizing, distributed=FASTEST)) == (4, "ddp", True)
    prior = default_step_time_fit()
    costly = prior.model_copy(update={"coefficients": [*prior.coefficients[:7], 3.0, 0.0, 0.0]})
    decision = _choose(64, cards=4, policy=resizing, distributed=FASTEST, fit=costly)
    assert _ran_as(decision) == (1, None, True)
    assert isinstance(decision, RunAsPlanned) and decision.plan.accumulation > 1
    assert "no plan on more cards that fits is predicted faster" in decision.plan.reason
    # As asked on one card, when it fits, runs there whatever the preference.
    assert _ran_as(_choose(16, cards=4, distributed=FASTEST)) == (1, None, True)
