"""The distributed rungs of the plan ladder: as asked on one card, then the fewest ranks (DDP
before FSDP2), then the single-card resizes, then a hand-back naming each world size's need.

digits-cnn (width 16, resolution 32) on 12 MiB simulated cards, 10 % margin (11.3 MB): batch 16
needs 5.2 MB on one card; batch 64 needs 20.3 MB, 10.3 MB a rank on 2; batch 256 needs 10.2 MB a
rank on 8 (tests/e2e/test_multigpu.py uses the same sizes). Cost: a few seconds of traces.
"""

from __future__ import annotations

import pytest

from service.wire import DistributedPolicy, MemoryPolicy
from worker.device.gpu import parse_size, simulated_card
from worker.plan.distributed import DistributedHandBack, choose_distributed, world_sizes
from worker.plan.policy import Decision, RunAsPlanned, choose_plan
from worker.run.training import TorchTaskRunner
from worker.tasks.digits import DigitsCNNTask
from worker.trial.runner import CardSpec

TASK = DigitsCNNTask()
RUNNER = TorchTaskRunner(TASK)
CARD = CardSpec(info=simulated_card(parse_size("12MiB")))
FREE = CARD.info.total_bytes
AS_ASKED_ONLY = MemoryPolicy(allow_resize=False)
BOTH = DistributedPolicy()


def _config(batch: int) -> dict[str, int]:
    return {"width": 16, "depth": 2, "resolution": 32, "batch_size": batch}


def _choose(
    batch: int,
    cards: int,
    policy: MemoryPolicy = AS_ASKED_ONLY,
    distributed: DistributedPolicy = BOTH,
) -> Decision:
    config = _config(batch)

    def on_one_card(given: MemoryPolicy) -> Decision:
        return choose_plan(RUNNER, config, given, CARD, FREE)

    return choose_distributed(TASK, config, policy, distributed, CARD, FREE, cards, on_one_card)


def test_world_sizes_divide_the_batch_within_the_cards_and_the_policy() -> None:
    assert world_sizes(12, BOTH, cards=8) == [2, 3, 4, 6]
    assert world_sizes(64, DistributedPolicy(max_world_size=2), cards=8) == [2]
    assert world_sizes(64, BOTH, cards=1) == []


def test_what_fits_one_card_as_asked_runs_on_one() -> None:
    decision = _choose(16, cards=4)
    assert isinstance(decision, RunAsPlanned)
    assert decision.plan.world_size == 1 and decision.plan.strategy is None


@pytest.mark.parametrize(("strategies", "chosen"), [(["ddp", "fsdp"], "ddp"), (["fsdp"], "fsdp")])
def test_the_fewest_ranks_that_hold_it_in_the_study_s_order(
    strategies: list[str], chosen: str
) -> None:
    decision = _choose(
        64, cards=4, distributed=DistributedPolicy.model_validate({"strategies": strategies})
    )
    assert isinstance(decision, RunAsPlanned)
    plan = decision.plan
    assert (plan.world_size, plan.strategy) == (2, chosen)
    per_rank = decision.prediction.peak_allocated_bytes
    assert per_rank <= FREE * 0.9
    assert f"2 ranks, {chosen}: {per_rank:,} bytes per rank" in plan.reason
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
