"""`vramtune tasks check` for a task that runs trials itself (TrainerTask, LightningTask, any
TrialRunner without a Task): its real path on one configuration, as a worker would run it.

A runner keeps no Task contract to check member by member, so the check follows a trial
instead: the batch parameter is there, the configuration is traced (the prediction a worker
plans with), it trains and evaluates for two steps to a finite metric, and it runs resized into
micro-batches (the rung every task takes) to a finite metric too. Each stage reports what it
found (predicted and measured peaks, the metric) and stops the check at the first broken rule,
as `vramtune.worker.tasks.contract.run_checks` does for a Task.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from contextlib import redirect_stdout

from vramtune.service.wire import Plan, Prediction, TrainBudget
from vramtune.worker.device.gpu import format_size, parse_size, simulated_card
from vramtune.worker.tasks.contract import Config, ContractBroken, Finding, require
from vramtune.worker.trial.runner import CardSpec, RunResult, TrialRunner, plan_for_micro_batch
from vramtune.worker.trial.task import TaskConfigError

CHECK_BUDGET = TrainBudget(max_steps=2, eval_every=1)
"""Two steps, evaluated after each: the smallest run that trains, steps the optimizer past its
first step (state allocated) and evaluates between steps as a trial does."""
CHECK_CARD_SIZE = parse_size("64GiB")
"""The simulated card a CPU check runs on: large enough that no small configuration is refused;
its limit is not what the check is about."""

Stage = Callable[["RunnerCheck"], str | None]


class _Reports:
    """A reporter that keeps what the run reported and never prunes."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def report(self, step: int, value: float) -> bool:
        self.values.append(value)
        return False

    def stop_reason(self) -> str | None:
        return None


class RunnerCheck:
    """One runner and configuration, checked stage by stage (each stage builds on the last)."""

    def __init__(self, runner: TrialRunner, config: Config, device: str) -> None:
        self.runner = runner
        self.config = config
        self.card = CardSpec(info=simulated_card(CHECK_CARD_SIZE), device=device)
        self.batch = 0
        self.as_asked: Prediction | None = None

    def declarations(self) -> str | None:
        """The configuration names the runner's batch size, at least 2 (so that it can split)."""
        try:
            self.batch = int(self.runner.batch_size(self.config))
        except KeyError as missing:
            raise ContractBroken(f"batch_size: the configuration has no {missing}") from None
        except TaskConfigError as refused:  # the runner's own words for a missing parameter
            raise ContractBroken(str(refused)) from None
        require(self.batch >= 2, "config", "give a batch size of at least 2")
        return None

    def trace(self) -> str | None:
        """The configuration is predicted by tracing, as a worker plans it."""
        self.as_asked = self._predict(Plan())
        return f"{_peak(self.as_asked)} predicted in {self.as_asked.seconds:.1f} s"

    def train_and_evaluate(self) -> str | None:
        """Two steps train and evaluate to a finite metric, measured beside the prediction."""
        return self._run(Plan(), self.as_asked)

    def resize(self) -> str | None:
        """The batch split into two micro-batches predicts, trains and evaluates too."""
        plan = plan_for_micro_batch(self.batch, math.ceil(self.batch / 2))
        return f"{plan.accumulation} micro-batches: " + self._run(plan, self._predict(plan))

    def _predict(self, plan: Plan) -> Prediction:
        prediction = self.runner.predict(self.config, plan, self.card)
        require(
            prediction.method == "trace",
            "predict",
            f"the configuration was not traced ({prediction.method}): {prediction.reason}",
        )
        return prediction

    def _run(self, plan: Plan, predicted: Prediction | None) -> str:
        reports = _Reports()
        started = time.monotonic()
        with redirect_stdout(sys.stderr):  # the report is stdout; a Trainer prints its logs
            result = self.runner.run(self.config, plan, CHECK_BUDGET, self.card, reports)
        require(result.values, "run", "returned no metric")
        require(
            all(math.isfinite(v) for v in [*result.values, *reports.values]),
            "run",
            f"the metric is not finite: {result.values}",
        )
        return _outcome(result, predicted, time.monotonic() - started)


def _peak(prediction: Prediction) -> str:
    return format_size(prediction.peak_allocated_bytes)


def _outcome(result: RunResult, predicted: Prediction | None, seconds: float) -> str:
    measured = format_size(result.measured.peak_allocated_bytes)
    said = f"metric {result.values[0]:.4g}, measured {measured}"
    if predicted is not None:
        said += f" (predicted {_peak(predicted)})"
    return f"{said} in {seconds:.1f} s"


STAGES: list[Stage] = [
    RunnerCheck.declarations,
    RunnerCheck.trace,
    RunnerCheck.train_and_evaluate,
    RunnerCheck.resize,
]


def run_runner_checks(runner: TrialRunner, config: Config, device: str = "cpu") -> list[Finding]:
    """The stages on `runner` up to the first broken one, each reported rather than raised."""
    check = RunnerCheck(runner, config, device)
    findings: list[Finding] = []
    for stage in STAGES:
        name = stage.__name__.replace("_", " ")
        try:
            findings.append(Finding(name, note=stage(check)))
        except ContractBroken as broken:
            findings.append(Finding(name, str(broken)))
        except Exception as error:  # the user's code raised: say where, not only what
            findings.append(Finding(name, f"raised {type(error).__name__}: {error}"))
        if not findings[-1].passed:
            break
    return findings
