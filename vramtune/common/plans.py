"""What identifies a run: a plan's key, its memory outcome, and the shape a shared prediction is
keyed by. The worker and the server both key by these."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, overload

from vramtune.service.wire import ParamValue, Plan, PlanOut

PlanKey = tuple[
    int | None, int, bool, bool, int | None, bool, int, str | None, str | None, bool, bool, bool
]


def plan_key(plan: Plan | PlanOut) -> PlanKey:
    """What makes two plans the same run: micro-batch, accumulation, checkpointing, bf16,
    the checkpointed blocks, the chunked loss, the world size, the data-parallel strategy and
    the optimizer swapped in, the activation and optimizer offloads, and whether FSDP2 reshards
    after forward (the reason is only words). A 2-rank and a 4-rank plan, DDP and FSDP at one
    world size, or FSDP keeping its parameters gathered and resharding them, hold different
    bytes per rank: they never share a key (issue 31)."""
    blocks = plan.checkpoint_blocks if plan.checkpointing else None
    return (
        plan.micro_batch,
        plan.accumulation,
        plan.checkpointing,
        plan.bf16,
        blocks,
        plan.chunked_loss,
        plan.world_size,
        plan.strategy,
        plan.optimizer,
        plan.activation_offload,
        plan.optimizer_offload,
        plan.reshard_after_forward,
    )


def plan_flags(plan: Plan | PlanOut) -> dict[str, Any]:
    """Everything of a plan but its micro-batches and reason: what a search over micro-batches
    keeps fixed (`vramtune.worker.trial.runner.plan_for_micro_batch(batch, micro, **flags)`)."""
    return {
        "checkpointing": plan.checkpointing,
        "checkpoint_blocks": plan.checkpoint_blocks if plan.checkpointing else None,
        "chunked_loss": plan.chunked_loss,
        "bf16": plan.bf16,
        "optimizer": plan.optimizer,
        "activation_offload": plan.activation_offload,
        "optimizer_offload": plan.optimizer_offload,
    }


def rungs_of(plan: Plan | PlanOut) -> list[str]:
    """The ladder's rungs (vramtune.service.wire.Resize names) a plan uses, in the ladder's
    order."""
    used = {
        "micro_batch": plan.accumulation > 1,
        "checkpointing": plan.checkpointing and plan.checkpoint_blocks is None,
        "selective_checkpointing": plan.checkpointing and plan.checkpoint_blocks is not None,
        "chunked_cross_entropy": plan.chunked_loss,
        "activation_offload": plan.activation_offload,
        "optimizer_offload": plan.optimizer_offload,
        "bf16": plan.bf16,
        "adamw_8bit": plan.optimizer == "adamw_8bit",
        "adafactor": plan.optimizer == "adafactor",
    }
    return [name for name, on in used.items() if on]


# Each rung in words, for people (the dashboard's legend, the trial view, the CLI).
RUNG_WORDS = {
    "micro_batch": "micro-batches",
    "checkpointing": "checkpointing",
    "selective_checkpointing": "selective checkpointing",
    "chunked_cross_entropy": "chunked cross-entropy",
    "activation_offload": "activations offloaded to host memory",
    "optimizer_offload": "optimizer offloaded to host memory",
    "bf16": "bf16",
    "adamw_8bit": "8-bit AdamW optimizer (changes numerics)",
    "adafactor": "Adafactor optimizer (changes numerics)",
}
KEPT_GATHERED_WORDS = "keeping parameters gathered"
"""FSDP2 with reshard_after_forward off, after its strategy ('2 ranks, fsdp keeping ...')."""


@overload
def plan_in_words(plan: Plan | PlanOut) -> str: ...
@overload
def plan_in_words(plan: None) -> None: ...
def plan_in_words(plan: Plan | PlanOut | None) -> str | None:
    """A plan's rungs in words, e.g. 'micro-batch 4 × 8, checkpoint the first 9 blocks, chunked
    cross-entropy, bf16, Adafactor optimizer (changes numerics)', after its ranks when above
    one ('2 ranks, ddp'; '2 ranks, fsdp keeping parameters gathered' when FSDP2 does not
    reshard after forward); 'as asked' without any; None without a plan. The dashboard's
    trial view and table and `vramtune study trials` all show this."""
    if plan is None:
        return None
    parts = [ranks_in_words(plan)] if plan.world_size > 1 else []
    if plan.micro_batch is not None and plan.accumulation > 1:
        parts.append(f"micro-batch {plan.micro_batch} × {plan.accumulation}")
    if plan.checkpointing:
        blocks = plan.checkpoint_blocks
        parts.append(
            "checkpoint every block" if blocks is None else f"checkpoint the first {blocks} blocks"
        )
    if plan.chunked_loss:
        parts.append(RUNG_WORDS["chunked_cross_entropy"])
    for offload in ("activation_offload", "optimizer_offload"):
        if getattr(plan, offload):
            parts.append(RUNG_WORDS[offload])
    if plan.bf16:
        parts.append(RUNG_WORDS["bf16"])
    if plan.optimizer is not None:
        parts.append(RUNG_WORDS[plan.optimizer])
    return ", ".join(parts) or "as asked"


def ranks_in_words(plan: Plan | PlanOut) -> str:
    """A several-card plan's ranks and wrapper: '2 ranks, fsdp', '2 ranks, fsdp keeping
    parameters gathered' (reshard_after_forward off)."""
    kept = "" if plan.reshard_after_forward else f" {KEPT_GATHERED_WORDS}"
    return f"{plan.world_size} ranks, {plan.strategy}{kept}"


def rungs_in_words(plan: Plan | PlanOut) -> str:
    """The rungs a plan uses, named without their sizes: 'micro-batches + checkpointing'
    (what the "where configurations fit" plot groups resized trials by)."""
    return " + ".join(RUNG_WORDS[name] for name in rungs_of(plan)) or "as asked"


def ran_as(plan: Plan | PlanOut, routed: bool) -> str:
    """A run's memory outcome: routed (a larger card after a hand-back), resized, or as_asked."""
    if routed:
        return "routed"
    return "resized" if rungs_of(plan) else "as_asked"


# Outcomes that already say how the trial ran (a completed run's ``ran_as``, or no run at all).
HOW_IT_RAN = frozenset({"as_asked", "resized", "routed", "infeasible"})


def told_outcome(
    outcome: str | None, plan: Mapping[str, Any] | None, handed_back: bool
) -> str | None:
    """The most informative outcome of a trial: how it ran, then how it ended when that differs.

    A stored outcome keeps the last thing that happened ("pruned", "oom", "failed"), which
    hides that the trial was routed to a larger card or resized first: those are shown both
    ("routed, pruned"). ``handed_back``: the trial waited for a larger card (its row's
    ``min_bytes`` > 0). The dashboard's table, the study list and ``vramtune study trials``
    all show this, so they agree.
    """
    if outcome is None or outcome in HOW_IT_RAN:
        return outcome
    how = "routed" if handed_back else _resized_or_not(plan)
    return outcome if how == "as_asked" else f"{how}, {outcome}"


def _resized_or_not(plan: Mapping[str, Any] | None) -> str:
    """ran_as of a stored plan (a JSON dict); "as_asked" without one."""
    if not plan:
        return "as_asked"
    return ran_as(stored_plan(plan), routed=False)


def stored_plan(plan: Mapping[str, Any]) -> PlanOut:
    """A stored plan (a JSON dict) as the wire shows it, keys it does not know dropped."""
    return PlanOut.model_validate({k: v for k, v in plan.items() if k in PlanOut.model_fields})


def shape_of(config: Mapping[str, Any], keys: Sequence[str] | None) -> dict[str, ParamValue]:
    """What a shared prediction is keyed by: the values of the task's shape keys in a trial's
    configuration (task_config overlaid with params); the whole configuration when the task
    declares none. Worker and server both key by this."""
    names = sorted(config) if keys is None else sorted(set(keys))
    return {name: config.get(name) for name in names}
