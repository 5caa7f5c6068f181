"""A trial's runner seen through the fleet's predictions: what another worker traced is not
traced again (service/fleet/predictions.py keeps them).

The assignment brings the fleet's predictions for the trial's task and shape on this worker's
card model and torch version. `shared(runner, config, assignment.predictions)` wraps the runner
for one plan choice: a prediction the fleet has is used as is; any other is the runner's own
and is collected in `made`, which the start (or hand-back) call sends for the fleet to share.

The largest-micro-batch solve is answered from known predictions when they settle it: a
micro-batch m that fits and m + 1 that does not (or m the whole batch). Else the runner's own
solver runs, and the prediction at m + 1 is made too (mostly a hit in the predictor's cache,
which the solve has just filled) so that the next worker's solve is settled without a trace.
One wrapper per trial, no state shared between trials: several may be chosen at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.wire import (
    Plan,
    PlanKey,
    Prediction,
    PredictionSource,
    SharedPrediction,
    TrainBudget,
    plan_key,
    shape_of,
)
from worker.policy import MicroBatchSearch
from worker.runner import CardSpec, Config, Reporter, RunResult, TrialRunner, plan_for_micro_batch


def shape_keys(runner: TrialRunner) -> list[str] | None:
    """The configuration keys a task's memory depends on: its shape parameters and its batch
    size (worker.task.Task); None when the runner declares none (all keys count then)."""
    task = getattr(runner, "task", runner)
    shapes = getattr(task, "shape_params", None)
    if shapes is None:
        return None
    batch = getattr(task, "batch_size_param", None)
    return sorted({*shapes, *([batch] if batch else [])})


class SharedPredictions:
    """A `TrialRunner` for one plan choice: the fleet's predictions first, then the runner's."""

    def __init__(
        self, runner: TrialRunner, config: Config, fleet: Sequence[SharedPrediction]
    ) -> None:
        self.runner = runner
        self.task_name = runner.task_name
        self.can_checkpoint = runner.can_checkpoint
        self.can_bf16 = runner.can_bf16
        self.shape = shape_of(config, shape_keys(runner))
        # A prediction for another shape is not this trial's (a server keyed differently).
        self._fleet = {plan_key(s.plan): s for s in fleet if s.shape == self.shape}
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

    def predict(self, config: Config, plan: Plan, card: CardSpec) -> Prediction:
        """The fleet's prediction for the plan when it has one, else the runner's (kept)."""
        key = plan_key(plan)
        shared = self._fleet.get(key)
        if shared is not None:
            if key not in self._mine():
                self._used.add(key)
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

    def _mine(self) -> set[PlanKey]:
        return {plan_key(made.plan) for made in self.made}


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
        """The largest micro-batch that fits `budget_bytes`: from known predictions when they
        settle it, else from the runner's solver (and the prediction just past its answer)."""
        batch = self.batch_size(config)
        flags = {"checkpointing": plan.checkpointing, "bf16": plan.bf16}
        settled, answer = self._settled(batch, flags, budget_bytes)
        if settled:
            return answer
        found = self.solver.largest_micro_batch(config, plan, budget_bytes, card)
        if found is None:  # not even 1 fits: the solver predicted it, so its cache has it
            self.predict(config, plan_for_micro_batch(batch, 1, **flags), card)
            return None
        micro, prediction = found
        self._keep(plan_for_micro_batch(batch, micro, **flags), prediction)
        if micro < batch:  # the witness that micro is the largest
            self.predict(config, plan_for_micro_batch(batch, micro + 1, **flags), card)
        return found

    def _settled(
        self, batch: int, flags: dict[str, bool], budget: int
    ) -> tuple[bool, tuple[int, Prediction] | None]:
        """(True, answer) when known predictions decide the solve, else (False, None)."""
        known: dict[int, tuple[PlanKey, Prediction]] = {}
        for key, shared in self._fleet.items():
            micro = shared.plan.micro_batch or batch
            if plan_key(plan_for_micro_batch(batch, micro, **flags)) == key:
                known[micro] = (key, shared.prediction)
        fitting = [micro for micro, (_, p) in known.items() if p.peak_bytes <= budget]
        if not fitting:
            if 1 not in known:
                return False, None
            self._use(known[1][0])
            return True, None
        best = max(fitting)
        above = known.get(best + 1)
        if best != batch and (above is None or above[1].peak_bytes <= budget):
            return False, None
        self._use(known[best][0])
        if above is not None:
            self._use(above[0])
        return True, (best, known[best][1])

    def _use(self, key: PlanKey) -> None:
        if key not in self._mine():
            self._used.add(key)


def shared(
    runner: TrialRunner, config: Config, fleet: Sequence[SharedPrediction]
) -> SharedPredictions:
    """The runner wrapped for one plan choice, with a solver when the runner has one."""
    if isinstance(runner, MicroBatchSearch):
        return SharedPredictionsWithSolver(runner, runner, config, fleet)
    return SharedPredictions(runner, config, fleet)
