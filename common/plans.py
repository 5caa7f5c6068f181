"""What identifies a run: a plan's key, its memory outcome, and the shape a shared prediction is
keyed by. The worker and the server both key by these."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from service.wire import ParamValue, Plan, PlanOut

PlanKey = tuple[int | None, int, bool, bool]


def plan_key(plan: Plan | PlanOut) -> PlanKey:
    """What makes two plans the same run: micro-batch, accumulation, checkpointing, bf16 (the
    reason is only words)."""
    return (plan.micro_batch, plan.accumulation, plan.checkpointing, plan.bf16)


def ran_as(plan: Plan | PlanOut, routed: bool) -> str:
    """A run's memory outcome: routed (a larger card after a hand-back), resized, or as_asked."""
    if routed:
        return "routed"
    resized = plan.accumulation > 1 or plan.checkpointing or plan.bf16
    return "resized" if resized else "as_asked"


def shape_of(config: Mapping[str, Any], keys: Sequence[str] | None) -> dict[str, ParamValue]:
    """What a shared prediction is keyed by: the values of the task's shape keys in a trial's
    configuration (task_config overlaid with params); the whole configuration when the task
    declares none. Worker and server both key by this."""
    names = sorted(config) if keys is None else sorted(set(keys))
    return {name: config.get(name) for name in names}
