"""What identifies a run: a plan's key, its memory outcome, and the shape a shared prediction is
keyed by. The worker and the server both key by these."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from service.wire import ParamValue, Plan, PlanOut

PlanKey = tuple[int | None, int, bool, bool, int | None, bool]


def plan_key(plan: Plan | PlanOut) -> PlanKey:
    """What makes two plans the same run: micro-batch, accumulation, checkpointing, bf16,
    the checkpointed blocks and the chunked loss (the reason is only words)."""
    blocks = plan.checkpoint_blocks if plan.checkpointing else None
    return (
        plan.micro_batch,
        plan.accumulation,
        plan.checkpointing,
        plan.bf16,
        blocks,
        plan.chunked_loss,
    )


def plan_flags(plan: Plan | PlanOut) -> dict[str, Any]:
    """Everything of a plan but its micro-batches and reason: what a search over micro-batches
    keeps fixed (`worker.trial.runner.plan_for_micro_batch(batch, micro, **flags)`)."""
    return {
        "checkpointing": plan.checkpointing,
        "checkpoint_blocks": plan.checkpoint_blocks if plan.checkpointing else None,
        "chunked_loss": plan.chunked_loss,
        "bf16": plan.bf16,
    }


def rungs_of(plan: Plan | PlanOut) -> list[str]:
    """The ladder's rungs (service.wire.Resize names) a plan uses, in the ladder's order."""
    used = {
        "micro_batch": plan.accumulation > 1,
        "checkpointing": plan.checkpointing and plan.checkpoint_blocks is None,
        "selective_checkpointing": plan.checkpointing and plan.checkpoint_blocks is not None,
        "chunked_cross_entropy": plan.chunked_loss,
        "bf16": plan.bf16,
    }
    return [name for name, on in used.items() if on]


def ran_as(plan: Plan | PlanOut, routed: bool) -> str:
    """A run's memory outcome: routed (a larger card after a hand-back), resized, or as_asked."""
    if routed:
        return "routed"
    return "resized" if rungs_of(plan) else "as_asked"


def shape_of(config: Mapping[str, Any], keys: Sequence[str] | None) -> dict[str, ParamValue]:
    """What a shared prediction is keyed by: the values of the task's shape keys in a trial's
    configuration (task_config overlaid with params); the whole configuration when the task
    declares none. Worker and server both key by this."""
    names = sorted(config) if keys is None else sorted(set(keys))
    return {name: config.get(name) for name in names}
