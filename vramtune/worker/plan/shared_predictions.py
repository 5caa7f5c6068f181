"""A trial's runner seen through the fleet's predictions: what another worker traced is not
traced again (vramtune/service/fleet/predictions.py keeps them).

The assignment brings the fleet's predictions for the trial's task and shape on this worker's
card model and torch version. `shared(runner, config, assignment.predictions)` wraps the runner
for one plan choice: a prediction the fleet has is used as is; any other is the runner's own
and is collected in `made`, which the start (or hand-back) call sends for the fleet to share.

The largest-micro-batch solve on a shape the fleet knows searches from the fleet's
predictions and predicts only micro-batches nobody predicted yet (none, for the same budget);
on a shape it does not know, the runner's own solver answers.
One wrapper per trial, no state shared between trials: several may be chosen at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vramtune.common.memory import peak_of
from vramtune.common.plans import PlanKey, plan_flags, plan_key, shape_of
from vramtune.service.wire import Plan, Prediction, PredictionSource, SharedPrediction, TrainBudget
from vramtune.worker.plan.policy import MicroBatchSearch
from vramtune.worker.trial.runner import (
    CardSpec,
    Config,
    PlanRungs,
    Reporter,
    RunResult,
    TrialRunner,
    micro_batch_choices,
    plan_for_micro_batch,
)


def shape_keys(runner: TrialRunner) -> list[str] | None:
    """The configuration keys a task's memory depends on: its shape parameters and its batch
    size (vramtune.worker.trial.task.Task); None when the runner declares none (all keys count
    then)."""
    task = getattr(runner, "task", runner)
    shapes = getattr(task, "shape_params", None)
    if shapes is None:
        return None
    batch = getattr(task, "batch_size_param", None)
    return sorted({*shapes, *([batch] if batch else [])})


def batch_param(runner: TrialRunner) -> str | None:
    """The configuration key holding the task's batch size; None when the runner names none."""
    batch = getattr(getattr(runner, "task", runner), "batch_size_param", None)
    return batch if isinstance(batch, str) and batch else None


class SharedPredictions:
    """A `TrialRunner` for one plan choice: the fleet's predictions first, then the runner's."""

    def __init__(
        self, runner: TrialRunner, config: Config, fleet: Sequence[SharedPrediction]
    ) -> None:
        self.runner = runner
        self.task_name = runner.task_name
        self.can_checkpoint = runner.can_checkpoint
        self.can_bf16 = runner.can_bf16
        self.can_swap_optimizer = bool(getattr(runner, "can_swap_optimizer", False))
        self.can_offload = bool(getattr(runner, "can_offload", False))
        self.costly_micro_batch_of_one = bool(getattr(runner, "costly_micro_batch_of_one", False))
        self.shape = shape_of(config, shape_keys(runner))
        # A prediction for another shape is not this trial's (a server keyed differently).
        self._fleet = {plan_key(s.plan): s for s in fleet if s.shape == self.shape}
        self._given = frozenset(self._fleet)  # the fleet's, apart from those made here
        self._used: set[PlanKey] = set()
        self.made: list[SharedPrediction] = []

    @property
    def source(self) -> PredictionSource | None:
        """Where the predictions of this choice came from (None: none was needed)."""
        if self._used and self.made:
            return "mixed"
        if self._used:
            return "fleet"
        return "worker" if self.made else None

    @property
    def fleet_used(self) -> int:
        """How many of the fleet's predictions this choice used."""
        return len(self._used)

    def batch_size(self, config: Config) -> int:
        """The configuration's effective batch size (the runner's)."""
        return self.runner.batch_size(config)

    def checkpoint_block_count(self, config: Config) -> int | None:
        """The runner's blocks for selective checkpointing (None: it has none)."""
        runner = self.runner
        return runner.checkpoint_block_count(config) if isinstance(runner, PlanRungs) else None

    def can_chunk_loss(self, config: Config) -> bool:
        """Whether the runner computes the loss in chunks when asked."""
        return isinstance(self.runner, PlanRungs) and self.runner.can_chunk_loss(config)

    def predict(self, config: Config, plan: Plan, card: CardSpec) -> Prediction:
        """The fleet's prediction for the plan when it has one, else the runner's (kept)."""
        key = plan_key(plan)
        shared = self._fleet.get(key)
        if shared is not None:
            if key in self._given:
                self._used.add(key)
                # Its seconds are what it costs here: nothing (the trace was another worker's).
                return shared.prediction.model_copy(update={"seconds": 0.0})
            return shared.prediction
        prediction = self.runner.predict(config, plan, card)
        self._keep(plan, prediction)
        return prediction

    def run(
        self, config: Config, plan: Plan, budget: TrainBudget, card: CardSpec, reporter: Reporter
    ) -> RunResult:
        """Run as the runner does (the wrapper only predicts)."""
        return self.runner.run(config, plan, budget, card, reporter)

    def _keep(self, plan: Plan, prediction: Prediction) -> None:
        """A prediction made here: the fleet's from now on (not one that predicted nothing)."""
        key = plan_key(plan)
        if prediction.method == "none" or key in self._fleet:
            return
        made = SharedPrediction(
            shape=self.shape, plan=plan.model_copy(update={"reason": ""}), prediction=prediction
        )
        self.made.append(made)
        self._fleet[key] = made


class SharedPredictionsWithSolver(SharedPredictions):
    """`SharedPredictions` for a runner that solves for the largest micro-batch itself."""

    def __init__(
        self,
        runner: TrialRunner,
        solver: MicroBatchSearch,
        config: Config,
        fleet: Sequence[SharedPrediction],
    ) -> None:
        super().__init__(runner, config, fleet)
        self.solver = solver

    def largest_micro_batch(
        self, config: Config, plan: Plan, budget_bytes: int, card: CardSpec
    ) -> tuple[int, Prediction] | None:
        """The largest micro-batch whose prediction fits `budget_bytes` under `plan`'s flags.

        Without the fleet's predictions for these flags, the runner's solver answers, and the
        predictions at micro-batch 1 and the whole batch are kept beside its answer (hits in
        the predictor's cache: the solve has just made them), so the next worker's search
        starts settled; a solver that says which it made (`predictions_solved`, a Trainer's,
        whose micro-batch of 1 traces a window of the whole batch) has those kept instead.
        With the fleet's, the search narrows the bracket they give, predicting only what is
        not known, over the even splits the policy runs.
        """
        batch = self.batch_size(config)
        flags = plan_flags(plan)

        def at(micro: int) -> Prediction:
            return self.predict(config, plan_for_micro_batch(batch, micro, **flags), card)

        known = self._known_peaks(batch, flags)
        if not any(key in self._given for key in known.values()):
            found = self.solver.largest_micro_batch(config, plan, budget_bytes, card)
            solved = getattr(self.solver, "predictions_solved", None)
            if solved is not None:  # a solver that says what it traced: the fleet keeps that
                for micro, prediction in solved(config, plan, card).items():
                    self._keep(plan_for_micro_batch(batch, micro, **flags), prediction)
            else:
                at(batch)
                if found is None or found[0] < batch:
                    at(1)  # the fleet learns that not even 1 fits, or the lines' lower anchor
            if found is not None:
                self._keep(plan_for_micro_batch(batch, found[0], **flags), found[1])
            return found
        peaks = {micro: peak_of(self._fleet[key].prediction) for micro, key in known.items()}
        return largest_fitting(at, batch, peaks, budget_bytes, even=True)

    def _known_peaks(self, batch: int, flags: dict[str, Any]) -> dict[int, PlanKey]:
        """Micro-batches with a known prediction under these flags, and their plans' keys."""
        known = {}
        for key, shared in self._fleet.items():
            micro = shared.plan.micro_batch or batch
            if plan_key(plan_for_micro_batch(batch, micro, **flags)) == key:
                known[micro] = key
        return known


def largest_fitting(
    at: Callable[[int], Prediction],
    batch: int,
    peaks: Mapping[int, int],
    budget: int,
    *,
    even: bool = False,
) -> tuple[int, Prediction] | None:
    """The largest micro-batch in [1, batch] (`even`: of an even split) whose prediction `at`
    fits `budget`, for a peak that grows with the micro-batch: the bracket [fits, does not
    fit] the known `peaks` give, narrowed by secant steps (a bisection after a step that did
    not halve it). Exact: it ends on a micro-batch that fits next to one that does not, or
    where the line through two fitting micro-batches below puts the next one over (the peak
    is a maximum of affine terms, so that line never over-states it)."""
    if even:
        return _largest_even(at, batch, peaks, budget)
    hi = min((m for m, peak in peaks.items() if peak > budget), default=batch + 1)
    lo = max((m for m, peak in peaks.items() if peak <= budget and m < hi), default=0)
    if lo == 0:
        lo_p = at(1)
        if peak_of(lo_p) > budget:
            return None
        lo = 1
    else:
        lo_p = at(lo)
    if hi <= batch:
        hi_p = at(hi)
    else:
        hi_p = lo_p if lo == batch else at(batch)
        if peak_of(hi_p) <= budget:
            return batch, hi_p
        hi = batch
    halve = False
    while hi - lo > 1:
        width = hi - lo
        guess = (lo + hi) // 2 if halve else _secant(lo, lo_p, hi, hi_p, budget)
        prediction = at(guess)
        if peak_of(prediction) <= budget:
            lo, lo_p = guess, prediction
        else:
            hi, hi_p = guess, prediction
        halve = hi - lo > width // 2
    return lo, lo_p


def _largest_even(
    at: Callable[[int], Prediction], batch: int, peaks: Mapping[int, int], budget: int
) -> tuple[int, Prediction] | None:
    """`largest_fitting` over the even splits: searched by their count of micro-batches."""
    choices = micro_batch_choices(batch)
    index = {micro: i + 1 for i, micro in enumerate(choices)}  # 1-based: 0 is "none fits"
    known = {index[m]: peak for m, peak in peaks.items() if m in index}
    below = sorted((m, peak) for m, peak in peaks.items() if peak <= budget)
    hi = min((m for m, peak in peaks.items() if peak > budget), default=batch + 1)
    lo = max((m for m, _ in below if m < hi), default=0)
    if lo and len(below) >= 2 and lo == below[-1][0]:
        (m0, p0), (m1, p1) = below[-2], below[-1]
        beyond = [m for m in choices if lo < m < hi]
        if not beyond or p1 + (p1 - p0) * (beyond[0] - m1) / (m1 - m0) > budget:
            return lo, at(lo)
    found = largest_fitting(lambda i: at(choices[i - 1]), len(choices), known, budget)
    return None if found is None else (choices[found[0] - 1], found[1])


def _secant(lo: int, lo_p: Prediction, hi: int, hi_p: Prediction, budget: int) -> int:
    """Where the line through the bracket's ends meets the budget, strictly inside it."""
    slope = (peak_of(hi_p) - peak_of(lo_p)) / (hi - lo)
    guess = lo + math.floor((budget - peak_of(lo_p)) / slope) if slope > 0 else lo + 1
    return min(max(guess, lo + 1), hi - 1)


def shared(
    runner: TrialRunner, config: Config, fleet: Sequence[SharedPrediction]
) -> SharedPredictions:
    """The runner wrapped for one plan choice, with a solver when the runner has one."""
    if isinstance(runner, MicroBatchSearch):
        return SharedPredictionsWithSolver(runner, runner, config, fleet)
    return SharedPredictions(runner, config, fleet)
