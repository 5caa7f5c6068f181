"""Outcome mapping: how the end of a run becomes the trial's final call to the server.

Pure functions of what the run left behind (a result, an out-of-memory, a stop, an error, a
hand-back), so the rules can be read and tested apart from the loop that calls them.
"""

from __future__ import annotations

import math

from vramtune.common.memory import peak_of
from vramtune.service.wire import (
    Assignment,
    CompleteRequest,
    FailKind,
    FailRequest,
    HandBackRequest,
    Measured,
    Plan,
    PlanChoice,
    Prediction,
    StartRequest,
    StepTimeObservation,
)
from vramtune.worker.plan.policy import HandBack, RunAsPlanned
from vramtune.worker.trial.runner import RunResult, Stopped

FinalRequest = CompleteRequest | FailRequest | HandBackRequest

# Why a stop order ends a trial, and what the server is told: a paused study gets its trial back
# to offer again; a deleted study or a lost lease has nobody left to tell.
STOP_KINDS: dict[str, FailKind | None] = {
    "pruned": "pruned",
    "paused": "interrupted",
    "interrupted": "interrupted",
    "deleted": None,
    "lease_lost": None,
    # The server refused this worker's token (revoked, expired): no call can be made any
    # more, and the server offers the trial again itself.
    "token_refused": None,
}


def completed(
    assignment: Assignment,
    result: RunResult,
    plan: Plan,
    prediction: Prediction,
    step_time: StepTimeObservation | None = None,
) -> CompleteRequest | FailRequest:
    """The complete call, with the measured peak appended when the study minimizes it; a
    failure when the task gave the wrong number of values or one that is not finite."""
    values = list(result.values)
    if assignment.minimize_peak_memory:
        values.append(float(peak_of(result.measured)))
    if len(values) != assignment.n_objectives or not all(map(math.isfinite, values)):
        message = f"values {values}: the study needs {assignment.n_objectives} finite ones"
        return failed(assignment, "error", message, plan, prediction, result.measured)
    return CompleteRequest(
        lease=assignment.lease,
        values=values,
        plan=plan,
        prediction=prediction,
        measured=result.measured,
        duration_s=result.duration_s,
        samples_per_s=result.samples_per_s,
        step_time=step_time,
    )


def stopped(
    assignment: Assignment, stop: Stopped, plan: Plan, prediction: Prediction, trained: bool
) -> FailRequest | None:
    """The fail call of a stopped run; None when nobody is left to tell (deleted, lease lost).

    The peak goes with it only when the run `trained` a step: a peak measured before the first
    step is the model's build, not a training run, and would bias the calibration low.
    """
    kind = STOP_KINDS.get(str(stop.reason), "interrupted")
    if kind is None:
        return None
    measured = stop.measured if trained else None
    return failed(assignment, kind, str(stop.reason), plan, prediction, measured)


def failed(
    assignment: Assignment,
    kind: FailKind,
    message: str,
    plan: Plan | None = None,
    prediction: Prediction | None = None,
    measured: Measured | None = None,
) -> FailRequest:
    """A fail call (the message cut to the contract's 4096 characters)."""
    return FailRequest(
        lease=assignment.lease,
        kind=kind,
        message=message[:4096],
        plan=plan,
        prediction=prediction,
        measured=measured,
    )


def handed_back(assignment: Assignment, decision: HandBack, choice: PlanChoice) -> HandBackRequest:
    """The hand-back call of a trial no allowed plan fits here, with how that was found."""
    return HandBackRequest(
        lease=assignment.lease,
        min_footprint_bytes=decision.min_footprint_bytes,
        plan=decision.plan,
        reason=decision.reason[:4096],
        fits_here=getattr(decision, "fits_here", False),  # vramtune/worker/plan/time_routing.py
        rank_needs=list(getattr(decision, "rank_needs", ())) or None,  # plan/distributed.py
        **dict(choice),
    )


def started(
    assignment: Assignment,
    decision: RunAsPlanned,
    choice: PlanChoice,
    cards: list[int] | None = None,
) -> StartRequest:
    """The start call of a trial that runs here as planned (on a node: on `cards`), with how
    the plan was chosen."""
    return StartRequest(
        lease=assignment.lease,
        plan=decision.plan,
        prediction=decision.prediction,
        cards=cards,
        **dict(choice),
    )


def error_message(error: BaseException) -> str:
    """An error's message, or its type's name when it has none. A KeyError's message is only
    the key ("'batch_size'"): it says which key is missing, as a trial's error must."""
    if isinstance(error, KeyError) and len(error.args) == 1:
        return f"KeyError: the configuration (task_config and params) has no key {error.args[0]!r}"
    text = str(error)
    return text if text else type(error).__name__
