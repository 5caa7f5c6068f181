"""The step-time model as both sides apply it: log step_s = b . features (service/step_time.py
fits it from the fleet's runs; workers compare plans and route by it)."""

from __future__ import annotations

import math

from vramtune.service.wire import StepTimeFit, StepTimeObservation

DEFAULT_OVERHEAD_SAMPLES = 8.0
"""The fixed model: a micro-batch costs as much as 8 more samples (launches, a cold device)."""
DEFAULT_CHECKPOINT_SLOWDOWN = 4 / 3
"""The fixed model: checkpointing recomputes the forward pass, about a third more compute."""
DEFAULT_CHUNKED_LOSS_SLOWDOWN = 1.05
"""The fixed model: chunked cross-entropy recomputes the output layer's forward in backward."""
DEFAULT_RANK_DOUBLING_SLOWDOWN = 1.07
"""The fixed model: each doubling of the ranks adds about 7 % to a rank's step (gradients
reduced, parameters gathered) beyond its share of the batch, which the micro-batch terms count."""
DEFAULT_FSDP_SLOWDOWN = 1.1
"""The fixed model: FSDP2 gathers each unit's parameters in forward and backward, DDP does not."""
DEFAULT_ACTIVATION_OFFLOAD_SLOWDOWN = 2.0
"""The fixed model: `save_on_cpu` copies every tensor the forward saves to pinned host memory
and back in backward, on the compute stream (no overlap). A transformer block saves ~34·d
values a token and computes ~72·d² flops on them (forward and backward); over PCIe (~25 GB/s
pinned on gen4) against fp32/TF32 matmuls the copies take as long as the compute around
d ≈ 2-4k and longer below: about doubling a step is the middle of that range, and more than
checkpointing's third (4/3), so the ladder takes checkpointing first where both fit. The
fleet's runs refine it."""
DEFAULT_OPTIMIZER_OFFLOAD_SLOWDOWN = 1.5
"""The fixed model: the optimizer state on the host costs, per step, the gradients' copy to the
host and the parameters' copy back (8 B a fp32 parameter each way over PCIe) and an AdamW step
on the CPU (~28 B of host memory traffic a parameter) after the backward. It does not grow
with the batch as the compute (6 flops a parameter a token) does: at a few thousand tokens a
step it is about half the step's compute on a fp32 model; smaller steps pay more, larger ones
less. The fleet's runs refine it."""
DEFAULT_KEPT_GATHERED_SPEEDUP = 1.05
"""The fixed model: FSDP2 keeping its parameters gathered after forward (reshard_after_forward
off) skips the backward all-gather, one of its three collectives a step (all-gather in forward
and backward, reduce-scatter of the gradients), which leaves it DDP's volume (an all-reduce is a
reduce-scatter and an all-gather): about half of FSDP's extra cost over DDP saved, so a step
about 5 % faster than resharding. It changes the cost, so it has a term the fit learns."""
DEFAULT_ADAMW_8BIT_SLOWDOWN = 3.3
"""The fixed model: torchao's 8-bit AdamW dequantizes and requantizes both moments each step; on
the CPU card, where its update runs eagerly (worker/trial/optimizers.py), a step took 3.3 times
AdamW's on a 4-block char transformer (13 times where the step is little but the update;
bench/results/optimizer_rungs.md). A GPU compiles the update and likely pays far less: the
fleet's fit learns each card's cost from its runs."""
DEFAULT_ADAFACTOR_SLOWDOWN = 1.0
"""The fixed model: no cost a priori; Adafactor's step measured 0.82 and 2.4 times AdamW's on
the CPU card (a compute-bound and an update-bound configuration, bench/results/
optimizer_rungs.md), neither typical enough to choose."""
STEP_TIME_MIN_RUNS = 3
"""Runs needed before an absolute step time is predicted (the intercept needs data)."""


def step_time_prior() -> list[float]:
    """The fixed model's coefficients (intercept, samples, checkpointing, bf16, sizes, chunked
    loss, world size, FSDP, activation offload, optimizer offload, FSDP keeping parameters
    gathered, 8-bit AdamW, Adafactor): terms are only ever appended (coefficients_of)."""
    return [
        0.0,
        1.0,
        math.log(DEFAULT_CHECKPOINT_SLOWDOWN),
        0.0,
        0.0,
        0.0,
        math.log(DEFAULT_CHUNKED_LOSS_SLOWDOWN),
        math.log(DEFAULT_RANK_DOUBLING_SLOWDOWN) / math.log(2),
        math.log(DEFAULT_FSDP_SLOWDOWN),
        math.log(DEFAULT_ACTIVATION_OFFLOAD_SLOWDOWN),
        math.log(DEFAULT_OPTIMIZER_OFFLOAD_SLOWDOWN),
        -math.log(DEFAULT_KEPT_GATHERED_SPEEDUP),
        math.log(DEFAULT_ADAMW_8BIT_SLOWDOWN),
        math.log(DEFAULT_ADAFACTOR_SLOWDOWN),
    ]


def default_step_time_fit(card_model: str = "", task: str = "") -> StepTimeFit:
    """The fixed model: what plans are compared by before anything was measured."""
    return StepTimeFit(
        card_model=card_model,
        task=task,
        overhead_samples=DEFAULT_OVERHEAD_SAMPLES,
        coefficients=step_time_prior(),
        n_observations=0,
    )


def step_time_features(x: StepTimeObservation, overhead: float) -> list[float]:
    """The model's inputs for one run (logs of sizes floored at 1). Checkpointing counts by
    the share of blocks it recomputes: selective checkpointing of k of L blocks costs k/L of
    checkpointing them all. A distributed run's micro-batches are one rank's share; its world
    size, FSDP and FSDP keeping its parameters gathered then add their own terms, so the fit
    learns each world size's and each wrapper's cost; a swapped optimizer (the adamw_8bit and
    adafactor rungs) adds its own."""
    checkpointed = 1.0 if x.checkpointed_fraction is None else x.checkpointed_fraction
    return [
        1.0,
        math.log(x.micro_batches * (x.micro_batch + overhead)),
        float(x.checkpointing) * checkpointed,
        float(x.bf16),
        math.log(max(x.parameter_bytes, 1)),
        math.log(max(x.as_asked_peak_bytes, 1)),
        float(x.chunked_loss),
        math.log(x.world_size),
        float(x.strategy == "fsdp"),
        float(x.activation_offload),
        float(x.optimizer_offload),
        float(x.strategy == "fsdp" and not x.reshard_after_forward),
        float(x.optimizer == "adamw_8bit"),
        float(x.optimizer == "adafactor"),
    ]


def predicted_step_s(fit: StepTimeFit, x: StepTimeObservation) -> float | None:
    """Seconds per optimizer step for these features; None before STEP_TIME_MIN_RUNS runs."""
    if fit.n_observations < STEP_TIME_MIN_RUNS:
        return None
    return math.exp(_dot(step_time_features(x, fit.overhead_samples), coefficients_of(fit)))


def step_time_slowdown(fit: StepTimeFit, x: StepTimeObservation) -> float:
    """Time per step of `x`'s plan relative to the same configuration as asked."""
    asked = x.model_copy(
        update={
            "micro_batches": 1,
            "micro_batch": x.batch_size,
            "checkpointing": False,
            "checkpointed_fraction": None,
            "chunked_loss": False,
            "bf16": False,
            "world_size": 1,
            "strategy": None,
            "activation_offload": False,
            "optimizer_offload": False,
            "reshard_after_forward": True,
            "optimizer": None,
        }
    )
    ours = step_time_features(x, fit.overhead_samples)
    theirs = step_time_features(asked, fit.overhead_samples)
    difference = [a - b for a, b in zip(ours, theirs, strict=True)]
    return math.exp(_dot(difference, coefficients_of(fit)))


def coefficients_of(fit: StepTimeFit) -> list[float]:
    """The fit's coefficients for this version's terms: a fit made before a term existed takes
    the prior's for it, and a newer server's terms past ours are dropped (its older terms keep
    their places: terms are only ever appended)."""
    prior = step_time_prior()
    return [*fit.coefficients[: len(prior)], *prior[len(fit.coefficients) :]]


def _dot(a: list[float], b: list[float]) -> float:
    return sum(p * q for p, q in zip(a, b, strict=True))
