"""The shared outcome rule (vramtune.common.plans.told_outcome), a plan in words
(vramtune.common.plans.plan_in_words) and human byte units (vramtune.common.units)."""

from __future__ import annotations

import pytest

from vramtune.common.plans import plan_in_words, rungs_in_words, told_outcome
from vramtune.common.units import GIB, MIB, human_bytes
from vramtune.service.cli.console import trial_rows
from vramtune.service.wire import PlanOut, TrialOut

AS_ASKED = {"micro_batch": None, "accumulation": 1, "checkpointing": False, "bf16": False}
HALVED = {"micro_batch": 8, "accumulation": 2, "checkpointing": False, "bf16": False}
CHUNKED = {**AS_ASKED, "chunked_loss": True}


@pytest.mark.parametrize(
    ("outcome", "plan", "handed_back", "told"),
    [
        ("pruned", AS_ASKED, True, "routed, pruned"),  # the case the table used to hide
        ("pruned", HALVED, False, "resized, pruned"),
        ("pruned", AS_ASKED, False, "pruned"),
        ("oom", HALVED, True, "routed, oom"),
        ("failed", None, False, "failed"),
        ("routed", AS_ASKED, True, "routed"),
        ("infeasible", None, True, "infeasible"),  # handed back, but it never ran
        ("resized", HALVED, False, "resized"),
        ("pruned", CHUNKED, False, "resized, pruned"),  # a rung that keeps the batch whole
        (None, None, True, None),
    ],
)
def test_the_most_informative_outcome(
    outcome: str | None, plan: dict[str, object] | None, handed_back: bool, told: str | None
) -> None:
    assert told_outcome(outcome, plan, handed_back) == told


@pytest.mark.parametrize(
    ("count", "shown"),
    [
        (154_372_163, "147 MiB"),
        (64 * MIB, "64.0 MiB"),
        (6 * GIB, "6.00 GiB"),
        (-2 * GIB, "-2.00 GiB"),
        (512, "512 B"),
        (None, "\u2013"),
    ],
)
def test_bytes_in_human_units(count: int | None, shown: str) -> None:
    assert human_bytes(count) == shown


def test_study_trials_shows_the_told_outcome() -> None:
    """`vramtune study trials` prints the same outcome as the dashboard's table."""
    trial = TrialOut(
        id=1, number=0, state="PRUNED", params={}, outcome="pruned", told_outcome="routed, pruned"
    )
    lines = trial_rows([trial]).splitlines()
    assert "OUTCOME" in lines[0]
    assert "routed, pruned" in lines[-1]


EVERY_RUNG = PlanOut(
    micro_batch=4,
    accumulation=8,
    checkpointing=True,
    checkpoint_blocks=9,
    chunked_loss=True,
    bf16=True,
)


@pytest.mark.parametrize(
    ("plan", "words", "rungs"),
    [
        (
            EVERY_RUNG,
            "micro-batch 4 × 8, checkpoint the first 9 blocks, chunked cross-entropy, bf16",
            "micro-batches + selective checkpointing + chunked cross-entropy + bf16",
        ),
        (PlanOut(checkpointing=True), "checkpoint every block", "checkpointing"),
        (PlanOut(), "as asked", "as asked"),
        (PlanOut(world_size=2, strategy="fsdp"), "2 ranks, fsdp", "as asked"),
        (
            PlanOut(world_size=4, strategy="fsdp", reshard_after_forward=False, micro_batch=2),
            "4 ranks, fsdp keeping parameters gathered",
            "as asked",
        ),
    ],
)
def test_a_plan_in_words(plan: PlanOut, words: str, rungs: str) -> None:
    assert plan_in_words(plan) == words
    assert rungs_in_words(plan) == rungs


def test_study_trials_shows_the_plan_in_words() -> None:
    trial = TrialOut(id=1, number=0, state="COMPLETE", params={}, plan=EVERY_RUNG)
    lines = trial_rows([trial]).splitlines()
    assert "PLAN" in lines[0]
    assert "micro-batch 4 × 8, checkpoint the first 9 blocks" in lines[-1]
