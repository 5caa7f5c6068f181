"""A plan's key, in memory (vramtune.common.plans.plan_key: the worker's tried plans, the fleet's
predictions) and as the shared-prediction index's column (service.fleet.predictions.plan_column):
a several-card plan's world size and strategy are part of it (issue 31), a one-card plan's key
is what it was before."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from vramtune.common.plans import plan_key
from vramtune.service.fleet.predictions import plan_column
from vramtune.service.wire import MAX_WORLD_SIZE, Plan, PlanOut


def test_plans_on_other_world_sizes_or_strategies_never_share_a_key() -> None:
    plans = [
        Plan(),
        Plan(world_size=2, strategy="ddp"),
        Plan(world_size=2, strategy="fsdp"),
        Plan(world_size=2, strategy="fsdp", reshard_after_forward=False),
        Plan(world_size=4, strategy="fsdp"),
        Plan(world_size=4, strategy="fsdp", micro_batch=4, accumulation=2),
    ]
    assert len({plan_key(p) for p in plans}) == len(plans)
    assert len({plan_column(p) for p in plans}) == len(plans)
    # How it ran (PlanOut) keys as the plan it ran.
    ran = PlanOut(world_size=4, strategy="fsdp", reason="fewest cards that hold it")
    assert plan_key(ran) == plan_key(Plan(world_size=4, strategy="fsdp"))


def test_a_one_card_plan_keeps_its_column_and_a_several_card_one_adds_its_ranks() -> None:
    assert plan_column(Plan()) == "allx1:ckpt=0:bf16=0"
    resized = Plan(micro_batch=16, accumulation=4, checkpointing=True, checkpoint_blocks=3)
    assert plan_column(resized) == "16x4:ckpt=1:bf16=0:blocks=3"
    assert plan_column(Plan(chunked_loss=True, bf16=True)) == "allx1:ckpt=0:bf16=1:cce=1"
    assert plan_column(Plan(world_size=2, strategy="ddp")) == "allx1:ckpt=0:bf16=0:ws=2:ddp"
    gathered = Plan(world_size=2, strategy="fsdp", reshard_after_forward=False)
    assert plan_column(gathered) == "allx1:ckpt=0:bf16=0:ws=2:fsdpg"
    longest = Plan(
        micro_batch=10**6,
        accumulation=10**6,
        checkpointing=True,
        checkpoint_blocks=10**4,
        chunked_loss=True,
        bf16=True,
        world_size=MAX_WORLD_SIZE,
        strategy="fsdp",
        reshard_after_forward=False,
        optimizer="adafactor",
    )
    assert len(plan_column(longest)) <= 64  # vramtune_predictions.plan_key is String(64)
    offloaded = longest.model_copy(
        update={"world_size": 1, "strategy": None, "activation_offload": True}
    )
    offloaded = offloaded.model_copy(update={"optimizer_offload": True})
    assert len(plan_column(offloaded)) <= 64  # the offload rungs run on one card only
    with pytest.raises(ValidationError, match="offload rungs run on one card"):
        Plan(world_size=2, strategy="ddp", optimizer_offload=True)


def test_an_adafactor_plan_keys_apart_and_a_plan_without_it_keeps_its_json() -> None:
    swapped = Plan(micro_batch=2, accumulation=2, optimizer="adafactor")
    assert plan_key(swapped) != plan_key(Plan(micro_batch=2, accumulation=2))
    assert plan_column(swapped) == "2x2:ckpt=0:bf16=0:ada"
    assert "optimizer" not in Plan().model_dump(mode="json")  # old plans read as before
    assert "optimizer" not in PlanOut().model_dump(mode="json")
    ran = PlanOut.model_validate(swapped.model_dump(mode="json"))
    assert plan_key(ran) == plan_key(swapped)


def test_an_8bit_adamw_plan_keys_apart_from_adafactor_and_the_task_optimizer() -> None:
    plans = [
        Plan(micro_batch=2, accumulation=2, optimizer=o) for o in (None, "adafactor", "adamw_8bit")
    ]
    assert len({plan_key(plan) for plan in plans}) == 3
    assert plan_column(plans[2]) == "2x2:ckpt=0:bf16=0:a8"
    ran = PlanOut.model_validate(plans[2].model_dump(mode="json"))
    assert plan_key(ran) == plan_key(plans[2])


def test_fsdp_resharding_after_forward_is_the_default_left_out_of_the_json() -> None:
    resharding = Plan(world_size=2, strategy="fsdp")
    assert "reshard_after_forward" not in resharding.model_dump(mode="json")
    gathered = resharding.model_copy(update={"reshard_after_forward": False})
    assert gathered.model_dump(mode="json")["reshard_after_forward"] is False
    ran = PlanOut.model_validate(gathered.model_dump(mode="json"))
    assert plan_key(ran) == plan_key(gathered) != plan_key(resharding)
    for wrapper in ({}, {"world_size": 2, "strategy": "ddp"}):  # DDP and one card never reshard
        with pytest.raises(ValidationError, match="reshard_after_forward=false goes with the fsdp"):
            Plan.model_validate({**wrapper, "reshard_after_forward": False})
