"""Route by predicted time: a trial that fits this card only resized, and much slower than as
asked, is handed back to a larger card of the fleet that holds it as asked.

choose_plan (worker/plan/policy.py) picks the fastest plan that fits *this* card; it never asks
whether another card would run the trial faster. On the tuning-efficiency benchmark smaller
cards ran large char-transformer configurations in micro-batches, several times the 4.2 CPU-s
the 256 MiB card takes for them as asked (bench/results/tuning_efficiency.md). With the assignment's
`larger_card_bytes` (the largest live card of another worker for the task, from the server),
a plan whose predicted time per step (the fleet's step-time model) is at least SLOW_RESIZE
times the as-asked one is handed back when that card holds the as-asked footprint with the
study's margin. The hand-back says the trial fits here (`fits_here`): should that card be gone
by then, the server re-offers the trial instead of ending it infeasible.

Assumed: the larger card is about as fast per step as this one (the step-time model is per card
model; a slower large card would need its own fit compared here, which the assignment does not
carry), and it is worth waiting for: at SLOW_RESIZE = 2, waiting for up to one such trial there
still finishes no later than running here.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramtune.common.plans import plan_in_words
from vramtune.common.step_time import default_step_time_fit, step_time_slowdown
from vramtune.service.wire import MemoryPolicy, StepTimeFit
from vramtune.worker.plan.policy import Decision, HandBack, RunAsPlanned

SLOW_RESIZE = 2.0
"""Predicted slowdown (time per step against as asked) from which a larger card is preferred."""


@dataclass(frozen=True)
class HandBackForTime(HandBack):
    """A hand-back of a trial that fits here, resized, for a larger card that runs it faster."""

    fits_here: bool = True


def prefer_larger_card(
    decision: Decision,
    larger_card_bytes: int | None,
    policy: MemoryPolicy,
    fit: StepTimeFit | None,
) -> Decision:
    """`decision`, or a hand-back to the larger card when it runs the trial much faster."""
    if not isinstance(decision, RunAsPlanned) or decision.step_time is None:
        return decision
    features = decision.step_time
    as_asked = features.as_asked_peak_bytes
    if not larger_card_bytes or as_asked <= 0:
        return decision
    if as_asked > int(larger_card_bytes * (1.0 - policy.margin)):
        return decision  # no card of the fleet holds it as asked: resizing is the way
    slowdown = step_time_slowdown(fit or default_step_time_fit(), features)
    if slowdown < SLOW_RESIZE:
        return decision
    reason = (
        f"fits here only as {plan_in_words(decision.plan)}, predicted {slowdown:.1f}x "
        f"slower a step than as asked; a card of {larger_card_bytes} bytes holds it as asked"
    )
    return HandBackForTime(as_asked, decision.plan, reason[:4096], decision.seconds)
